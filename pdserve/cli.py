"""The ``pdserve`` command: one subcommand per job; heavy imports happen inside each."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from pdserve.config import QUANTIZATION_CHOICES


def _generate(args: argparse.Namespace) -> int:
    if args.router:
        return _generate_remote(args)
    from pdserve import LLM
    from pdserve.engine.model.tokenizer import NoChatTemplateError
    from pdserve.engine.request import SamplingParams

    try:
        llm = LLM(
            args.model, dtype=args.dtype, quantization=args.quantization, max_model_len=args.max_model_len
        )
    except ValueError as exc:  # a tokenizer that cannot be built, a bad --quantization for the file
        print(f"error: {exc}", file=sys.stderr)
        return 2
    prompt: str | list[int] = args.prompt  # text: the model's add-BOS rule applies
    if args.chat:
        try:  # the template writes any BOS itself: token ids, none added on top
            prompt = llm.chat_prompt([{"role": "user", "content": args.prompt}])
        except NoChatTemplateError:
            print(
                "error: --chat: the model has no chat template; leave out --chat to complete the prompt as plain text",
                file=sys.stderr,
            )
            return 2
        except ValueError as exc:  # the template refused the message
            print(f"error: --chat: {exc}", file=sys.stderr)
            return 2
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    try:
        start = time.perf_counter()
        completion = llm.generate([prompt], params)[0]
        elapsed = time.perf_counter() - start
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.prompt}{completion.text}" if not args.chat else completion.text)
    n = len(completion.token_ids)
    print(
        f"[{n} tokens in {elapsed:.2f}s: {n / elapsed:.1f} tokens/s, "
        f"TTFT {completion.metrics['ttft_s'] * 1000:.0f} ms, finish_reason={completion.finish_reason}]",
        file=sys.stderr,
    )
    return 0


def _generate_remote(args: argparse.Namespace) -> int:
    import grpc

    from pdserve.client import Client
    from pdserve.tls import ClientTls

    start = time.perf_counter()
    metrics: dict = {}
    try:
        tls = None
        if args.tls or args.ssl_ca_certs or args.ssl_certfile:
            tls = ClientTls(args.ssl_ca_certs, args.ssl_certfile, args.ssl_keyfile)
        with Client(args.router, api_key=args.api_key, tls=tls) as client:
            for delta in client.stream(
                prompt=args.prompt,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                seed=args.seed,
                chat=args.chat,
                timeout=args.timeout,
            ):
                print(delta.text, end="", flush=True)
                if delta.finish_reason:
                    metrics = delta.metrics
    except grpc.RpcError as exc:
        print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 2
    except ValueError as exc:  # a bad key or TLS file
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print()
    print(
        f"[{time.perf_counter() - start:.2f}s, TTFT {metrics.get('ttft_ms', 0):.0f} ms, "
        f"KV transfer {metrics.get('transfer_ms', 0):.1f} ms, prefill {metrics.get('prefill_engine') or '-'}, "
        f"decode {metrics.get('decode_engine') or '-'}]",
        file=sys.stderr,
    )
    return 0


# {`pdserve bench NAME`: the module whose main(argv) runs it}; a benchmark that spans files is a
# package of pdserve.bench, its driver module runs it.
BENCHMARKS = {
    "engine": "pdserve.bench.engine",
    "transfer": "pdserve.bench.transfer",
    "kernels": "pdserve.bench.kernels",
    "serve": "pdserve.bench.serve.driver",
    "handover": "pdserve.bench.handover",
    "throughput": "pdserve.bench.throughput.driver",
    "peers": "pdserve.bench.peers.driver",
    "step": "pdserve.bench.step",
    "models": "pdserve.bench.models.driver",
    "perplexity": "pdserve.bench.perplexity.driver",
    "routing": "pdserve.bench.routing",
}


def _bench(what: str, rest: list[str]) -> int:
    """Each benchmark owns its arguments (and its --help)."""
    import importlib

    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    module = importlib.import_module(BENCHMARKS[what])
    return int(module.main(rest) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion with the colocated engine")
    gen.add_argument("prompt")
    gen.add_argument(
        "--model", default=None, help="GGUF file or HF directory (default: bundled SmolLM2-135M)"
    )
    gen.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16"])
    gen.add_argument(
        "--quantization",
        default=None,
        choices=list(QUANTIZATION_CHOICES),
        help="auto (the default: a GGUF file's blocks where the kernels build), weights as they are in "
        "the GGUF file (gguf), int8 blocks made at load, or dense (none); -a8: the same weights with "
        "int8 activations in the decode matmuls",
    )
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--max-model-len", type=int, default=2048)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument(
        "--router", default=None, help="send to a running router (HOST:PORT) instead of loading the model"
    )
    gen.add_argument("--timeout", type=float, default=None, help="deadline in seconds (with --router)")
    gen.add_argument(
        "--api-key", default=None, help="the router's API key (with --router; default: $PDSERVE_API_KEY)"
    )
    gen.add_argument("--tls", action="store_true", help="reach the router over TLS (system roots)")
    gen.add_argument(
        "--ssl-ca-certs", default=None, help="PEM roots to verify the router with (implies --tls)"
    )
    gen.add_argument(
        "--ssl-certfile", default=None, help="client certificate, for mutual TLS (implies --tls)"
    )
    gen.add_argument("--ssl-keyfile", default=None, help="private key of --ssl-certfile")
    gen.set_defaults(func=_generate)

    from pdserve.decode import server as decode_server
    from pdserve.prefill import server as prefill_server

    for name, module in (("prefill", prefill_server), ("decode", decode_server)):
        role = sub.add_parser(name, help=f"run a {name} engine (gRPC server + engine core)")
        module.add_args(role)
        role.set_defaults(func=module.main)

    from pdserve.engine import server as engine_server

    colocated = sub.add_parser(
        "serve", help="run a colocated engine (no KV transfer) behind the Engine gRPC API"
    )
    engine_server.add_engine_args(colocated)
    colocated.set_defaults(
        func=lambda args: engine_server.run_engine_server(args, role="colocated", kv_role=None)
    )

    from pdserve.router import server as router_server

    router = sub.add_parser("router", help="run the gRPC router in front of prefill and decode engines")
    router_server.add_args(router)
    router.set_defaults(func=router_server.main)

    from pdserve import cluster

    local = sub.add_parser("cluster", help="run a router + prefill + decode engines as local processes")
    cluster.add_args(local)
    local.set_defaults(func=cluster.main)

    bench = sub.add_parser("bench", help=f"benchmarks ({', '.join(BENCHMARKS)})")
    bench.add_argument("what", choices=BENCHMARKS)
    bench.add_argument(
        "args", nargs=argparse.REMAINDER, help="the benchmark's own arguments (see its --help)"
    )
    bench.set_defaults(func=lambda args: _bench(args.what, args.args))
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) >= 2 and argv[0] == "bench" and argv[1] in BENCHMARKS:
        return _bench(argv[1], argv[2:])
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
