"""Natural-language prompt material for correctness tests.

Greedy equivalence is checked on real text rather than random token ids: real text gives
confident logits, so a comparison fails on a real bug, not on a numerical near-tie.
"""

PARAGRAPHS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden screw press. Books became cheaper, "
    "literacy spread across Europe, and scientists could share their results with colleagues in "
    "distant cities within months instead of years.",
    "Photosynthesis is the process by which green plants use sunlight to turn water and carbon "
    "dioxide into glucose and oxygen. It takes place in the chloroplasts, where chlorophyll "
    "absorbs mostly blue and red light and reflects green light, which is why leaves look green.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "print([fibonacci(i) for i in range(10)])\n",
    "The river Seine flows through Paris, the capital of France. Along its banks stand the "
    "Louvre, the cathedral of Notre-Dame and the Eiffel Tower, which was built for the World's "
    "Fair of 1889 and was at first criticised by many of the city's artists.",
    "In mathematics, a prime number is a natural number greater than one that has no divisors "
    "other than one and itself. The first primes are 2, 3, 5, 7, 11 and 13. Euclid proved more "
    "than two thousand years ago that there are infinitely many of them.",
    "Water boils at one hundred degrees Celsius at sea level, but at lower temperatures on high "
    "mountains, because the air pressure is lower. This is why cooking pasta takes longer in the "
    "Alps than in a kitchen by the sea.",
    "The Great Wall of China is not a single wall but a series of fortifications built over many "
    "centuries by different dynasties to protect against invasions from the north. Its total "
    "length, including all of its branches, is more than twenty thousand kilometres.",
    "A computer's memory hierarchy trades speed for size: registers are fastest and smallest, "
    "then the caches, then main memory, and finally disks and the network. Programs run fast "
    "when the data they touch most often stays in the upper levels of that hierarchy.",
]


def long_text(num_chars: int, start: int = 0) -> str:
    """At least ``num_chars`` characters of text, starting at paragraph ``start``."""
    parts: list[str] = []
    i = start
    while sum(len(p) + 2 for p in parts) < num_chars:
        parts.append(PARAGRAPHS[i % len(PARAGRAPHS)])
        i += 1
    return "\n\n".join(parts)


def prompts_of_lengths(tokenizer, lengths: list[int]) -> list[list[int]]:
    """Token-id prompts of exactly the given lengths, each from a different starting paragraph."""
    prompts = []
    for n, length in enumerate(lengths):
        ids = tokenizer.encode(long_text(length * 6 + 200, start=n))
        assert len(ids) >= length, "corpus too short for the requested prompt length"
        prompts.append(ids[:length])
    return prompts
