"""``make demo``: a 1 prefill + 1 decode cluster on the bundled model, a few prompts through it.

For each prompt it streams the text as it arrives, then shows which path the router took
(prefill engine -> KV transfer -> decode engine, or decode alone when the uncached part of the
prompt is short), the time to first token and the transfer time (prefill's answer -> decode's
first token). Then one chat request goes through the router's OpenAI-compatible HTTP API with
the official ``openai`` SDK, streamed. It ends with every engine's KV accounting (nothing left
in use) and stops the cluster.

    python -m pdserve.demo [--model PATH] [--kv-transport auto|tcp|ucx|nixl]
"""

from __future__ import annotations

import argparse
import sys
import time

import grpc
import openai

from pdserve.client import Client
from pdserve.cluster import ClusterError, LocalCluster
from pdserve.config import KV_TRANSPORTS

ARTICLE = (
    "The river Seine flows through Paris, the capital of France. Along its banks stand the Louvre, "
    "the cathedral of Notre-Dame and the Eiffel Tower, which was built for the World's Fair of 1889 "
    "and was at first criticised by many of the city's artists. Today it is the most visited paid "
    "monument in the world."
)

# (prompt, apply the chat template, max tokens): a short plain prompt (decode alone), a chat
# question and a long prompt (both through prefill), then the long prompt's prefix again (the
# decode engine has it cached, so the router skips prefill).
PROMPTS = [
    ("The capital of France is", False, 24),
    ("What is the capital of France? Answer in one sentence.", True, 40),
    (f"{ARTICLE}\n\nQuestion: When was the Eiffel Tower built?\nAnswer:", False, 24),
    (f"{ARTICLE}\n\nQuestion: Who criticised the Eiffel Tower at first?\nAnswer:", False, 16),
]


def _path(metrics: dict) -> str:
    if metrics.get("prefill_engine"):
        return f"prefill {metrics['prefill_engine']} -> decode {metrics['decode_engine']}"
    return f"decode {metrics.get('decode_engine', '?')} alone (short uncached part: no prefill)"


def run_prompts(client: Client) -> None:
    for i, (prompt, chat, max_tokens) in enumerate(PROMPTS, 1):
        shown = prompt if len(prompt) <= 90 else f"{prompt[:40]} ... {prompt[-45:]}"
        print(f"\n[{i}/{len(PROMPTS)}] {'(chat) ' if chat else ''}{shown!r}", flush=True)
        print("  -> ", end="", flush=True)
        metrics: dict = {}
        num_tokens = 0
        start = time.perf_counter()
        for delta in client.stream(prompt=prompt, chat=chat, max_tokens=max_tokens, timeout=120):
            print(delta.text.replace("\n", "\n     "), end="", flush=True)
            num_tokens += len(delta.token_ids)
            metrics = delta.metrics or metrics
        elapsed = time.perf_counter() - start
        print(flush=True)
        num_prompt = metrics.get("num_prompt_tokens", 0)
        if metrics.get("prefill_engine"):
            transfer = f"{metrics['transfer_ms']:.1f} ms"
            prompt_kv = f"prompt {num_prompt} tokens, KV computed by prefill"
        else:  # decode reports the tokens its prefix cache already held
            transfer = "none"
            prompt_kv = (
                f"prompt {num_prompt} tokens, {metrics.get('num_cached_tokens', 0)} from decode's cache"
            )
        print(
            f"  path: {_path(metrics)}\n"
            f"  TTFT {metrics.get('ttft_ms', 0.0):.1f} ms | transfer {transfer} | "
            f"{num_tokens} tokens in {elapsed * 1000:.0f} ms | {prompt_kv}",
            flush=True,
        )


def run_openai_sdk(base_url: str) -> None:
    """One streamed chat completion through the HTTP front door, as any OpenAI app would send it."""
    print(f"\n[OpenAI SDK] POST {base_url}/chat/completions (stream)", flush=True)
    sdk = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    model = sdk.models.list().data[0].id
    print(f"  model {model!r}\n  -> ", end="", flush=True)
    stream = sdk.chat.completions.create(
        model=model,
        messages=[
            {"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "Name three rivers of Europe."},
        ],
        max_tokens=40,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content.replace("\n", "\n     "), end="", flush=True)
        if chunk.usage is not None:
            usage = chunk.usage
    print(
        f"\n  usage: {usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens", flush=True
    )


def print_kv_accounting(client: Client, timeout_s: float = 10.0) -> None:
    """Every engine's KV use once idle: a finished request leaves nothing referenced or held."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = client.stats()
        idle = all(s["kv_usage"] == 0.0 and s["num_held_blocks"] == 0 for s in stats)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    print("\nKV accounting after the run:")
    for s in stats:
        print(
            f"  {s['role']:<7} {s['address']}: kv_usage {s['kv_usage']:.2f}, held blocks {s['num_held_blocks']}, "
            f"blocks pulled {s['num_blocks_pulled']}, prefix-cache hits {s['prefix_cache_hits']}/{s['prefix_cache_queries']}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.demo", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="GGUF file or HF directory (default: bundled SmolLM2-135M)"
    )
    parser.add_argument("--kv-transport", default="auto", choices=list(KV_TRANSPORTS))
    args = parser.parse_args(argv)

    print(
        "Starting 1 prefill + 1 decode engine and a router (the model loads in each engine) ...", flush=True
    )
    started = time.perf_counter()
    try:
        with LocalCluster(
            1,
            1,
            model=args.model,
            kv_transport=args.kv_transport,
            http_port=0,
            progress=lambda message: print(f"  [cluster] {message}", flush=True),
        ) as cluster:
            print(f"Cluster up in {time.perf_counter() - started:.0f}s:\n{cluster.table()}", flush=True)
            with Client(cluster.router_address) as client:
                run_prompts(client)
                run_openai_sdk(cluster.http_url)
                print_kv_accounting(client)
            print("\nStopping the cluster ...", flush=True)
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except grpc.RpcError as exc:
        print(f"error: request failed: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except openai.APIError as exc:
        print(f"error: OpenAI API request failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted; cluster stopped", file=sys.stderr)
        return 130
    print("Done: every process stopped.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
