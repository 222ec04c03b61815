"""The engine sampler's OpenAI / vLLM parameters against references worked out by hand.

Every expected number below is written out from the formulas (vLLM v1's order: min_tokens
masking, repetition penalty, frequency and presence penalties, then greedy argmax, or
temperature -> min_p -> top-k/top-p -> draw), not computed by the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine.request import Request, RequestStatus, SamplingParams
from pdserve.engine.sampler import SamplingState, draw_seed, processed_logits, sample, sampling_distribution
from pdserve.engine.scheduler import check_stop

LOGITS = [2.0, 1.0, 0.5, -1.0, 0.0, 3.0]
VOCAB = len(LOGITS)
EOS = 5


def state(prompt: list[int], outputs: list[int] = (), eos: int | None = EOS, **params) -> SamplingState:
    return SamplingState.create(
        SamplingParams(max_tokens=64, **params), eos, list(prompt), list(outputs), VOCAB
    )


def processed(st: SamplingState, logits: list[float] = LOGITS) -> list[float]:
    return processed_logits(torch.tensor([logits]), [st])[0].tolist()


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    # Seen: prompt tokens 0 and 3, output token 5. 2/2, -1*2, 3/2; the others untouched.
    st = state([0, 3], outputs=[5], repetition_penalty=2.0)
    assert processed(st) == [1.0, 1.0, 0.5, -2.0, 0.0, 1.5]
    assert sample(torch.tensor([LOGITS]), [st]) == [5]  # greedy: 1.5 is still the largest


def test_frequency_and_presence_penalties_count_output_tokens_only():
    # Outputs 5, 5, 1: token 5 loses 2 * 0.5 + 0.25, token 1 loses 0.5 + 0.25; prompt token 2 nothing.
    st = state([2], outputs=[5, 5, 1], frequency_penalty=0.5, presence_penalty=0.25)
    assert processed(st) == [2.0, 0.25, 0.5, -1.0, 0.0, 1.75]
    assert sample(torch.tensor([LOGITS]), [st]) == [0]
    # The sampled token counts from now on: another 0 costs it 0.5 + 0.25.
    assert processed(st)[0] == pytest.approx(1.25)


def test_negative_presence_penalty_rewards_repeats():
    st = state([], outputs=[4], presence_penalty=-2.0)
    assert processed(st)[4] == 2.0


def test_prior_output_tokens_are_outputs_for_the_penalties():
    # P/D: the decode engine's prompt ends with the prefill's token 5 (num_prior_output_tokens=1).
    split = state([0, 3, 5], frequency_penalty=1.0, repetition_penalty=2.0, num_prior_output_tokens=1)
    whole = state([0, 3], outputs=[5], frequency_penalty=1.0, repetition_penalty=2.0)
    # Token 5: 3 / 2 - 1 * 1 = 0.5; tokens 0 and 3 by repetition only.
    assert processed(split) == processed(whole) == [1.0, 1.0, 0.5, -2.0, 0.0, 0.5]


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    st = state([1], min_tokens=2, stop_token_ids=[0])
    assert processed(st) == [-math.inf, 1.0, 0.5, -1.0, 0.0, -math.inf]
    assert sample(torch.tensor([LOGITS]), [st]) == [1]
    assert sample(torch.tensor([LOGITS]), [st]) == [1]
    assert sample(torch.tensor([LOGITS]), [st]) == [EOS]  # two generated: EOS is allowed again


def test_min_tokens_masks_eos_even_with_ignore_eos_and_counts_only_this_engines_tokens():
    st = state([1, 2], min_tokens=1, ignore_eos=True, num_prior_output_tokens=1)
    assert processed(st)[EOS] == -math.inf


def test_min_p_keeps_tokens_within_the_fraction_of_the_top_probability():
    # p_i / p_5 = exp(l_i - 3): 0.368 (token 0) >= 0.3 is kept; 0.135, 0.082, 0.018, 0.050 are not.
    st = state([], temperature=1.0, min_p=0.3)
    probs = sampling_distribution(torch.tensor(processed(st)), st.params).tolist()
    p0 = 1 / (1 + math.e)
    assert probs == pytest.approx([p0, 0.0, 0.0, 0.0, 0.0, 1 - p0], abs=1e-6)


def test_min_p_applies_after_temperature():
    # T = 2 halves the gaps: p_0 / p_5 = exp(-0.5) = 0.607 and p_1 / p_5 = exp(-1) = 0.368 pass 0.3.
    st = state([], temperature=2.0, min_p=0.3)
    probs = sampling_distribution(torch.tensor(processed(st)), st.params).tolist()
    weights = [math.exp(-0.5), math.exp(-1.0), 0.0, 0.0, 0.0, 1.0]
    assert probs == pytest.approx([w / sum(weights) for w in weights], abs=1e-6)


def test_penalties_shape_the_sampling_distribution_before_temperature():
    # Prompt token 0, outputs 5, 5: repetition 2 gives token 0 -> 1.0 and token 5 -> 1.5, then
    # frequency 0.25 * 2 takes token 5 to 1.0. Temperature 2 then halves every logit.
    st = state([0], outputs=[5, 5], temperature=2.0, repetition_penalty=2.0, frequency_penalty=0.25)
    probs = sampling_distribution(torch.tensor(processed(st)), st.params).tolist()
    penalised = [1.0, 1.0, 0.5, -1.0, 0.0, 1.0]
    weights = [math.exp(x / 2) for x in penalised]
    assert probs == pytest.approx([w / sum(weights) for w in weights], abs=1e-6)


def test_min_tokens_removes_eos_and_stop_ids_from_the_sampling_distribution():
    st = state([], temperature=1.0, min_tokens=1, stop_token_ids=[0])
    probs = sampling_distribution(torch.tensor(processed(st)), st.params).tolist()
    weights = [0.0, math.exp(1.0), math.exp(0.5), math.exp(-1.0), 1.0, 0.0]
    assert probs == pytest.approx([w / sum(weights) for w in weights], abs=1e-6)
    st.append(1)  # one generated: nothing is masked any more
    assert processed(st) == LOGITS


def test_more_prior_outputs_than_prompt_tokens_count_the_whole_prompt_as_output():
    st = state([1, 5], frequency_penalty=1.0, num_prior_output_tokens=3)
    assert processed(st) == [2.0, 0.0, 0.5, -1.0, 0.0, 2.0]


def test_state_rebuilt_after_preemption_equals_the_incrementally_updated_one():
    kwargs = {"temperature": 1.0, "seed": 3, "frequency_penalty": 0.5, "num_prior_output_tokens": 1}
    live = state([0, 3, 5], **kwargs)
    for token in [5, 1, 1]:
        live.append(token)
    resumed = state([0, 3, 5], outputs=[5, 1, 1], **kwargs)
    assert resumed.output_counts.tolist() == live.output_counts.tolist() == [0, 2, 0, 0, 0, 2]
    assert resumed.prompt_mask.tolist() == live.prompt_mask.tolist()
    assert resumed.draw_index == live.draw_index == 4
    assert processed(resumed) == processed(live)


def _request_with_outputs(outputs: list[int], **params) -> Request:
    request = Request("r", [7, 8], SamplingParams(**params), eos_token_id=EOS)
    for token in outputs:
        request.append_output_token_ids(token)
    return request


def test_check_stop_ignores_eos_and_stop_ids_before_min_tokens():
    params = {"max_tokens": 8, "min_tokens": 3, "stop_token_ids": [4]}
    assert not check_stop(_request_with_outputs([EOS], **params), max_model_len=100)
    assert not check_stop(_request_with_outputs([1, 4], **params), max_model_len=100)
    stopped = _request_with_outputs([1, 2, EOS], **params)
    assert check_stop(stopped, max_model_len=100)
    assert stopped.status == RequestStatus.FINISHED_STOPPED
    by_stop_id = _request_with_outputs([1, 2, 4], **params)
    assert check_stop(by_stop_id, max_model_len=100) and by_stop_id.stop_reason == 4


def test_check_stop_length_limits_still_apply_before_min_tokens():
    capped = _request_with_outputs([1, 2], max_tokens=2, min_tokens=2)
    assert check_stop(capped, max_model_len=100)
    assert capped.status == RequestStatus.FINISHED_LENGTH_CAPPED
    too_long = _request_with_outputs([1], max_tokens=8, min_tokens=5)  # 2 prompt + 1 output tokens
    assert check_stop(too_long, max_model_len=3)
    assert too_long.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_a_batch_of_different_params_equals_each_row_alone():
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB) * 2

    def rows() -> list[SamplingState]:
        return [
            state([0, 1], outputs=[2], repetition_penalty=1.5),
            state([3], outputs=[4, 4], frequency_penalty=0.7, presence_penalty=-0.3),
            state([], min_tokens=3, stop_token_ids=[1]),
            state([5], temperature=0.9, seed=11, min_p=0.05, top_k=4),
        ]

    together = sample(logits.clone(), rows())
    alone = [sample(logits[i : i + 1].clone(), [st])[0] for i, st in enumerate(rows())]
    assert together == alone


def test_rows_without_penalties_keep_their_logits_untouched():
    logits = torch.tensor([LOGITS, LOGITS])
    out = processed_logits(logits, [state([0, 5]), state([0, 5], repetition_penalty=2.0)])
    assert out[0].tolist() == LOGITS
    assert out[1].tolist() != LOGITS


def test_seeded_draws_depend_on_seed_and_position_only():
    torch.manual_seed(1)
    steps = [torch.randn(1, VOCAB) for _ in range(6)]

    def run(prompt: list[int], prior: int, from_step: int, seed: int = 7) -> list[int]:
        st = state(prompt, temperature=1.0, seed=seed, num_prior_output_tokens=prior)
        return [sample(steps[i].clone(), [st])[0] for i in range(from_step, 6)]

    whole = run([1, 2], prior=0, from_step=0)
    assert whole == run([1, 2], prior=0, from_step=0)  # reproducible
    assert whole != run([1, 2], prior=0, from_step=0, seed=8)
    # Split like P/D: prefill draws token 0, decode (prompt + that token) draws the rest.
    first = run([1, 2], prior=0, from_step=0)[:1]
    rest = run([1, 2, first[0]], prior=1, from_step=1)
    assert first + rest == whole
    assert draw_seed(7, 0) != draw_seed(7, 1) != draw_seed(8, 0)
    assert 0 <= draw_seed(-5, 3) < 2**64


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("frequency_penalty", math.nan),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", math.inf),
        ("min_p", 1.5),
        ("min_p", -0.1),
        ("min_tokens", -1),
        ("min_tokens", 65),
        ("num_prior_output_tokens", -1),
    ],
)
def test_out_of_range_values_raise_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(max_tokens=64, **{field: value})


def _reference_penalised_greedy(
    hf, prompt: list[int], steps: int, rep: float, freq: float, pres: float
) -> list[int]:
    """Greedy decoding over the transformers model's logits with the penalties applied by hand."""
    ids = list(prompt)
    out: list[int] = []
    for _ in range(steps):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].float().tolist()
        for token in set(ids):
            logits[token] = logits[token] / rep if logits[token] > 0 else logits[token] * rep
        for token in set(out):
            logits[token] -= freq * out.count(token) + pres
        nxt = max(range(len(logits)), key=logits.__getitem__)
        ids.append(nxt)
        out.append(nxt)
    return out


def test_llm_greedy_with_penalties_equals_a_hand_written_reference(tiny_model_dir, tiny_llm):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompt = tiny_llm.tokenizer.encode("The river Seine flows through Paris, the capital of France.")
    plain = tiny_llm.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids
    params = SamplingParams(
        max_tokens=24, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2
    )
    penalised = tiny_llm.generate([prompt], params)[0].token_ids
    assert penalised != plain
    assert penalised == _reference_penalised_greedy(hf, prompt, 24, 1.3, 0.5, 0.2)
