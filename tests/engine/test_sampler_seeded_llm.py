"""Seeded sampling through the whole colocated engine on the tiny model.

A seeded request's k-th token is drawn from (seed, k) alone, so its tokens do not depend on the
batch it ran in, on being split like P/D (prefill draws token 0, decode gets prompt + that token
with ``num_prior_output_tokens=1``), or on being preempted and recomputed; its penalty counts
survive all of these too.
"""

from __future__ import annotations

import dataclasses

import pytest

from pdserve import LLM
from pdserve.engine.request import SamplingParams

TEXTS = [
    "The river Seine flows through Paris, the capital of France.",
    "A quick brown fox jumps over the lazy dog near the bank.",
    "In the beginning there was only the sea and the wind.",
    "Counting sheep: one, two, three, four, five, six, seven.",
]
SEEDED = SamplingParams(
    max_tokens=24,
    temperature=1.3,
    top_p=0.95,
    min_p=0.02,
    seed=1234,
    repetition_penalty=1.2,
    frequency_penalty=0.3,
    presence_penalty=0.2,
    min_tokens=6,
)


@pytest.fixture(scope="module")
def prompts(tiny_llm) -> list[list[int]]:
    return [tiny_llm.tokenizer.encode(text) for text in TEXTS]


def params_for(i: int) -> SamplingParams:
    return dataclasses.replace(SEEDED, seed=SEEDED.seed + i)


def test_same_seed_gives_the_same_tokens_alone_or_in_a_batch(tiny_llm, prompts):
    alone = tiny_llm.generate([prompts[0]], params_for(0))[0].token_ids
    again = tiny_llm.generate([prompts[0]], params_for(0))[0].token_ids
    batch = tiny_llm.generate(prompts, [params_for(i) for i in range(len(prompts))])
    assert alone == again == batch[0].token_ids
    other_seed = tiny_llm.generate([prompts[0]], dataclasses.replace(SEEDED, seed=99))[0].token_ids
    assert other_seed != alone


def test_split_like_prefill_then_decode_reproduces_the_colocated_tokens(tiny_llm, prompts):
    prompt = prompts[1]
    whole = tiny_llm.generate([prompt], SEEDED)[0]
    # What the router does: prefill gets max_tokens=1, decode the rest with the first token
    # appended to the prompt and counted as a prior output.
    first = tiny_llm.generate([prompt], dataclasses.replace(SEEDED, max_tokens=1, min_tokens=1))[0]
    rest = tiny_llm.generate(
        [prompt + first.token_ids],
        dataclasses.replace(
            SEEDED,
            max_tokens=SEEDED.max_tokens - 1,
            min_tokens=SEEDED.min_tokens - 1,
            num_prior_output_tokens=1,
        ),
    )[0]
    assert first.token_ids + rest.token_ids == whole.token_ids
    assert rest.finish_reason == whole.finish_reason


def test_preemption_keeps_seeded_draws_and_penalty_counts(tiny_model_dir, tiny_llm, prompts):
    params = [params_for(i) for i in range(len(prompts))]
    # A negative presence penalty: the random tiny model rarely repeats a token by itself, so
    # only a reward for repeats makes this row's tokens depend on the counts kept over preemption.
    greedy_penalised = SamplingParams(
        max_tokens=24, ignore_eos=True, presence_penalty=-1.0, repetition_penalty=0.8
    )
    params.append(greedy_penalised)
    batch = [*prompts, prompts[2]]
    reference = [tiny_llm.generate([p], sp)[0].token_ids for p, sp in zip(batch, params, strict=True)]
    # The five need 4 or 5 blocks of 16 each (28 to 45 prompt tokens + 24): 12 blocks hold two
    # or three at a time, so running requests get preempted and recomputed.
    small = LLM(tiny_model_dir, max_model_len=256, num_blocks=12, max_num_batched_tokens=256)
    got = [c.token_ids for c in small.generate(batch, params)]
    assert small.engine.scheduler.num_preemptions > 0, "the test must exercise preemption"
    assert got == reference
