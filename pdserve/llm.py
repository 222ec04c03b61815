"""``pdserve.LLM``: the colocated engine in-process, for scripts, tests and benchmarks."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from typing import cast

from pdserve.config import CacheConfig, ModelConfig, SchedulerConfig
from pdserve.engine.core import EngineCore, EngineCoreRequest
from pdserve.engine.model.loader import load_served_model
from pdserve.engine.model.tokenizer import check_tokenizer
from pdserve.engine.outputs import Completion
from pdserve.engine.request import SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | Sequence[int]


class LLM:
    """Load a model and generate with the full scheduler (batching, prefix cache, preemption).

    ``model=None`` is the bundled SmolLM2-135M-Instruct. Engine arguments are the fields of
    ``SchedulerConfig`` and ``CacheConfig`` plus ``dtype`` (default ``"auto"``: bf16 where the
    CPU has native bf16, else fp32) and ``quantization`` (default ``"auto"``: a GGUF file's
    blocks where the kernels build, else dense; ``"none"``: dense, ``"gguf"``: a GGUF file's
    quantized blocks as they are, ``"int8"``: Q8_0 blocks made at load; ``"gguf-a8"`` and
    ``"int8-a8"``: the same weights, with activations quantized to int8 per 32 inside the decode
    matmuls, as llama.cpp does). Torch's threads are
    left as this process has them.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str | None = None,
        quantization: str | None = None,
        max_model_len: int = 2048,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        enable_chunked_prefill: bool = True,
        long_prefill_token_threshold: int = 0,
        policy: str = "fcfs",
        block_size: int = 16,
        num_blocks: int = 1024,
        enable_prefix_caching: bool = True,
    ) -> None:
        # A tokenizer that cannot be built is refused before any weight is read.
        check_tokenizer(model)
        # None: ModelConfig's defaults ("auto", or $PDSERVE_DTYPE / $PDSERVE_QUANTIZATION).
        model_config = ModelConfig(
            path=model,
            **({} if dtype is None else {"dtype": dtype}),
            **({} if quantization is None else {"quantization": quantization}),
        )
        scheduler_config = SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            enable_chunked_prefill=enable_chunked_prefill,
            long_prefill_token_threshold=long_prefill_token_threshold,
            policy=policy,
        )
        cache_config = CacheConfig(
            block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=enable_prefix_caching
        )
        # "auto" picks bf16 on a CPU with native bf16 ($PDSERVE_DTYPE changes the default).
        loaded = load_served_model(model_config)
        self.dtype = str(loaded.dtype).removeprefix("torch.")
        self.tokenizer = loaded.tokenizer
        self.engine = EngineCore(loaded, scheduler_config, cache_config, kv_cache_dtype=loaded.dtype)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Run every prompt to completion as one batch; results in prompt order.

        All prompts are validated before any is queued, so a bad one raises ``ValueError`` and
        nothing else is affected.
        """
        prompt_list = self._as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (
            [sampling_params] * len(prompt_list)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params_list) != len(prompt_list):
            raise ValueError(f"sampling_params: got {len(params_list)} for {len(prompt_list)} prompts")
        requests = [
            EngineCoreRequest(
                request_id=f"llm-{next(self._ids)}",
                prompt_token_ids=self._tokenize(prompt),
                sampling_params=params,
            )
            for prompt, params in zip(prompt_list, params_list, strict=True)
        ]
        for request in requests:
            self.engine.validate(request)
        start = time.perf_counter()
        for request in requests:
            self.engine.add_request(request)
        token_ids: dict[str, list[int]] = {r.request_id: [] for r in requests}
        finish: dict[str, str | None] = {}
        first_token_at: dict[str, float] = {}
        num_cached: dict[str, int] = {}
        while self.engine.has_work():
            for output in self.engine.step():
                token_ids[output.request_id].extend(output.new_token_ids)
                first_token_at.setdefault(output.request_id, time.perf_counter() - start)
                num_cached.setdefault(output.request_id, output.num_cached_tokens)
                if output.finished:
                    finish[output.request_id] = output.finish_reason
        elapsed = time.perf_counter() - start
        return [
            Completion(
                request_id=r.request_id,
                token_ids=token_ids[r.request_id],
                text=self.tokenizer.decode(token_ids[r.request_id]),
                finish_reason=finish.get(r.request_id),
                metrics={
                    "ttft_s": first_token_at.get(r.request_id, elapsed),
                    "e2e_s": elapsed,
                    "num_cached_tokens": num_cached.get(r.request_id, 0),
                },
                prompt_token_ids=list(r.prompt_token_ids),
            )
            for r in requests
        ]

    def _tokenize(self, prompt: Prompt) -> list[int]:
        # Text gets the model's add-BOS/EOS rule (as llama.cpp's server and vLLM tokenize a
        # prompt); token ids are taken as given.
        if isinstance(prompt, str):
            return self.tokenizer.encode_prompt(prompt)
        return list(prompt)

    def chat_prompt(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Chat messages as prompt token ids: the model's chat template, no BOS added on top.

        Raises ``NoChatTemplateError`` when the model has no chat template.
        """
        return self.tokenizer.encode_chat(messages, add_generation_prompt)

    @staticmethod
    def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str):
            return [prompts]
        items = list(prompts)
        if items and all(isinstance(t, int) for t in items):
            return [cast(list[int], items)]  # a single prompt given as token ids
        return cast(list[Prompt], items)
