"""Command line: ``python -m engine serve`` and ``python -m engine generate``.

What the engine says while it starts and serves goes to the ``logging`` module (on
stderr, at ``--log-level``); stdout carries only what a caller reads: the
``ENGINE READY ws://HOST:PORT`` line of ``serve`` (the gateway waits for it) and the
reply of ``generate``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import secrets
import socket
import sys
import uuid
from dataclasses import asdict

from engine.config import EngineConfig
from engine.errors import ConfigError, EngineError
from engine.outputs import GenerateRequest
from engine.sampling_params import SamplingParams
from engine.tiers.disk import default_disk_dir


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The EngineConfig options, shared by every subcommand."""
    d = EngineConfig()
    p.add_argument("--model", default=os.environ.get("MODEL") or None,
                   help="local Hugging Face folder or .gguf file (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"],
                   help="activations (and unquantized weights); auto: the fastest sound format for the device "
                        "(docs/benchmarks.md); float32 alone is the exact mode, token for token as transformers "
                        "(default: %(default)s)")
    p.add_argument("--quantization", default=d.quantization,
                   choices=["auto", "int8", "int4", "int4-sym", "none"],
                   help="weight-only int8 with one scale per output row; int4: 4-bit in groups of 32 with a "
                        "scale and an offset each (int4-sym: a scale only), on the CPU kernels; or none "
                        "(default: %(default)s: docs/cpu_kernels.md)")
    p.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=["auto", "float32", "bfloat16", "float16"],
                   help="KV cache element type (default: %(default)s: bfloat16 on the CPU kernels, else the dtype)")
    p.add_argument("--speculative", default=d.speculative, choices=["auto", "ngram", "off"],
                   help="speculative decoding by prompt lookup: drafts from the request's own tokens, verified "
                        "in the decode step; never changes the output (default: %(default)s: on for the CPU)")
    p.add_argument("--num-draft-tokens", type=int, default=d.num_draft_tokens,
                   help="most draft tokens verified per request per step (default: %(default)s)")
    p.add_argument("--spec-ngram", default=f"{d.spec_ngram_min},{d.spec_ngram_max}", metavar="MIN,MAX",
                   help="n-gram sizes looked up, longest first (default: %(default)s)")
    p.add_argument("--spec-max-batch", type=int, default=d.spec_max_batch,
                   help="speculate only while at most this many requests decode at once (default: %(default)s)")
    p.add_argument("--cpu-isa", default=os.environ.get("CHATSERVE_CPU_ISA", d.cpu_isa),
                   choices=["auto", "portable", "avx2", "avxvnni", "avx512"],
                   help="instruction set the CPU kernels are built for (default: $CHATSERVE_CPU_ISA or %(default)s: "
                        "the best the CPU has)")
    p.add_argument("--no-cpu-kernels", action="store_true",
                   help="run torch's ops instead of the engine's CPU kernels (slower; for comparisons)")
    p.add_argument("--device", default=d.device, help="cpu, cuda, cuda:N or auto (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block (default: %(default)s)")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: sized from memory)")
    p.add_argument("--kv-cache-gib", type=float, default=None,
                   help="KV cache budget in GiB on the CPU (default: half the host memory available "
                        "after the weights load, at most 8, at least 0.25)")
    p.add_argument("--gpu-memory-fraction", type=float, default=d.gpu_memory_fraction,
                   help="share of the GPU memory free after the weights are loaded that the KV "
                        "cache takes (default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context limit in tokens (default: the model's own)")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="token budget of one step, i.e. the prefill chunk size (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="requests running at once at most; more wait in line (default: %(default)s)")
    p.add_argument("--no-prefix-cache", action="store_true", help="disable radix prefix caching")
    p.add_argument("--kv-disk-dir", default=None, metavar="DIR",
                   help="the disk KV tier's folder: cached prompt pages survive eviction and restarts "
                        "(KV_DISK_DIR; default: $CHATSERVE_CACHE/kv, else ~/.cache/chatserve/kv)")
    p.add_argument("--kv-disk-gib", type=float, default=None,
                   help="most GiB the disk KV tier keeps (default: 8, at most half the free disk)")
    p.add_argument("--kv-disk-write", default=os.environ.get("KV_DISK_WRITE", "through"),
                   choices=["through", "back", "idle"],
                   help="write a page to the disk tier as it enters the cache (through), when the pool "
                        "evicts it (back), or when evicted plus the cache's pages while idle and at a "
                        "graceful stop (idle) (default: $KV_DISK_WRITE or through: an eviction "
                        "writes nothing, every page is on disk already; docs/kv_tiers.md has the measurement)")
    p.add_argument("--no-kv-disk", action="store_true",
                   help="turn the disk KV tier off (so does KV_DISK=off, unless --kv-disk-dir is given)")
    p.add_argument("--kv-host", default=os.environ.get("KV_HOST", "auto"), choices=["auto", "on", "off"],
                   help="the host-memory KV tier between the pool and the disk: auto is on when the pool is "
                        "on a GPU, off on the CPU (default: $KV_HOST or auto)")
    p.add_argument("--kv-host-gib", type=float, default=None,
                   help="GiB of the host-memory KV tier (default: twice the pool, at most half the free "
                        "host memory)")
    p.add_argument("--schedule-policy", default=d.schedule_policy, choices=["fcfs", "lpm"],
                   help="waiting requests in arrival order (fcfs) or longest cached prefix first (lpm) "
                        "(default: %(default)s)")
    p.add_argument("--attention-backend", default=d.attention_backend, choices=["auto", "torch", "triton", "cpu"],
                   help="auto: Triton on CUDA, the CPU kernels on the CPU when they run the model, else torch "
                        "(default: %(default)s)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="run decode steps eagerly on CUDA (for debugging)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's choice)")
    p.add_argument("--role", default=os.environ.get("ENGINE_ROLE") or d.role, choices=["both", "prefill", "decode"],
                   help="both, or prefill / decode for prefill-decode disaggregation (default: %(default)s)")
    p.add_argument("--kv-pull-failure", default=d.kv_pull_failure, choices=["local", "fail"],
                   help="when pulling a prompt's pages fails: compute them here (local) or end the request "
                        "(fail) (default: %(default)s)")
    p.add_argument("--engine-seed", type=int, default=None,
                   help="seed of the shared generator for unseeded sampled requests (default: a new random "
                        "one each start, so unseeded replies differ from one start to the next)")


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    """Build the EngineConfig from parsed arguments (validated on construction).

    Raises:
        ConfigError: a bad setting, including ``--spec-ngram`` not of the form MIN,MAX.
    """
    try:
        ngram = [int(x) for x in a.spec_ngram.split(",")]
        if len(ngram) not in (1, 2):
            raise ValueError
    except ValueError:
        raise ConfigError(f"--spec-ngram must be MIN,MAX (two integers), got {a.spec_ngram!r}") from None
    return EngineConfig(
        model=a.model, dtype=a.dtype, device=a.device, block_size=a.block_size, num_blocks=a.num_blocks,
        kv_cache_bytes=int(a.kv_cache_gib * 2**30) if a.kv_cache_gib is not None else None,
        gpu_memory_fraction=a.gpu_memory_fraction,
        max_model_len=a.max_model_len, max_num_batched_tokens=a.max_num_batched_tokens,
        max_num_seqs=a.max_num_seqs, enable_prefix_cache=not a.no_prefix_cache,
        schedule_policy=a.schedule_policy, attention_backend=a.attention_backend,
        cuda_graphs=not a.no_cuda_graphs, threads=a.threads,
        seed=a.engine_seed if a.engine_seed is not None else secrets.randbits(63),
        quantization=a.quantization, kv_cache_dtype=a.kv_cache_dtype, cpu_kernels=not a.no_cpu_kernels,
        cpu_isa=a.cpu_isa, speculative=a.speculative, num_draft_tokens=a.num_draft_tokens,
        spec_ngram_min=ngram[0], spec_ngram_max=ngram[-1], spec_max_batch=a.spec_max_batch,
        role=a.role, kv_pull_failure=a.kv_pull_failure,
        kv_disk_dir=_kv_disk_dir(a),
        kv_disk_bytes=int(a.kv_disk_gib * 2**30) if a.kv_disk_gib is not None else None,
        kv_disk_write=a.kv_disk_write,
        kv_host=a.kv_host,
        kv_host_bytes=int(a.kv_host_gib * 2**30) if a.kv_host_gib is not None else None,
    )


def _kv_disk_dir(a: argparse.Namespace) -> str | None:
    """The disk KV tier's folder: ``--kv-disk-dir``, else ``KV_DISK_DIR``, else the default;
    None (off) with ``--no-kv-disk``, or with ``KV_DISK=off`` when no folder is named."""
    if a.no_kv_disk or (a.kv_disk_dir is None and os.environ.get("KV_DISK", "").lower() == "off"):
        return None
    return str(a.kv_disk_dir or os.environ.get("KV_DISK_DIR") or default_disk_dir())


LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str) -> None:
    """Log records at ``level`` and above to stderr, one line each. The websockets
    library's per-connection lines are kept for ``debug``."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, stream=sys.stderr)
    if level != "debug":
        logging.getLogger("websockets").setLevel(logging.WARNING)


def env_port(name: str, default: int) -> int:
    """The port in environment variable ``name``, or ``default`` when unset.

    Raises:
        ConfigError: the value is not an integer in [0, 65535] (the message names the variable).
    """
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ConfigError(f"bad environment variable {name}: expected a port in [0, 65535], got {raw!r}")
    return port


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m engine`` argument parser."""
    p = argparse.ArgumentParser(prog="python -m engine", description="LLM engine: serve or generate once")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                        help="what the engine logs on stderr: loading, sizes, warnings (default: %(default)s)")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", parents=[common], help="serve the internal WebSocket protocol")
    s.add_argument("--host", default=os.environ.get("ENGINE_HOST", "127.0.0.1"),
                   help="listen address (ENGINE_HOST; default: %(default)s)")
    s.add_argument("--port", type=int, default=None,
                   help="listen port, 0 picks a free one (ENGINE_PORT; default: 9000)")
    add_engine_args(s)
    g = sub.add_parser("generate", parents=[common], help="generate one reply and print it")
    g.add_argument("--prompt", required=True, help="the text to continue (with --chat: the user's message)")
    g.add_argument("--chat", action="store_true", help="apply the chat template (prompt = one user message)")
    g.add_argument("--system", default=None, help="system prompt (with --chat)")
    g.add_argument("--max-tokens", type=int, default=128, help="longest reply in tokens (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature, 0 for greedy (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass, 1 for off (default: %(default)s)")
    g.add_argument("--top-k", type=int, default=0,
                   help="keep the k most likely tokens, 0 for off (default: %(default)s)")
    g.add_argument("--seed", dest="req_seed", type=int, default=None,
                   help="makes a sampled reply reproducible (default: random)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end the reply at this text; repeatable (default: none)")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    add_engine_args(g)
    return p


async def _generate_once(a: argparse.Namespace, config: EngineConfig) -> int:
    from engine.async_engine import AsyncEngine

    engine = AsyncEngine.from_config(config, verbose=not a.json)
    engine.start()
    try:
        params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p,
                                top_k=a.top_k, seed=a.req_seed, stop=a.stop)
        if a.chat:
            msgs = ([{"role": "system", "content": a.system}] if a.system else []) + [
                {"role": "user", "content": a.prompt}]
            req = GenerateRequest(request_id=uuid.uuid4().hex, messages=msgs, params=params)
        else:
            req = GenerateRequest(request_id=uuid.uuid4().hex,
                                  prompt_token_ids=engine.prompts.encode_text(a.prompt), params=params)
        final = None
        async for out in engine.generate(req):
            if not a.json:
                sys.stdout.write(out.text)
                sys.stdout.flush()
            if out.finished:
                final = out
        if not a.json:
            sys.stdout.write("\n")  # the reply ends its line, like any command's output
            sys.stdout.flush()
        assert final is not None and final.usage is not None and final.timings is not None  # set when finished
        if a.json:
            print(json.dumps({"text": final.output_text, "token_ids": final.output_token_ids,
                              "finish_reason": final.finish_reason, "usage": asdict(final.usage),
                              "timings": asdict(final.timings)}, ensure_ascii=False))
        else:
            t = final.timings
            print(f"[{final.finish_reason}; {final.usage.completion_tokens} tokens; TTFT {t.ttft_ms:.0f} ms; "
                  f"TPOT {t.tpot_ms:.1f} ms]", file=sys.stderr)
        return 0
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code (2 on a clear user error: a bad
    setting, model or request, said in one line on stderr)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        a = build_parser().parse_args(argv)
        configure_logging(a.log_level)
        config = engine_config_from_args(a)
        if a.cmd == "serve":
            from engine.async_engine import AsyncEngine
            from engine.server import serve_forever

            if a.port is None:
                a.port = env_port("ENGINE_PORT", 9000)
            try:  # before the model loads: a taken port is reported at once
                with socket.socket() as probe:
                    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    probe.bind((a.host, a.port))
            except OSError as e:
                print(f"error: cannot serve on {a.host}:{a.port}: {e.strerror or e}", file=sys.stderr)
                return 1
            engine = AsyncEngine.from_config(config)
            try:
                serve_forever(engine, a.host, a.port)
            except OSError as e:
                print(f"error: cannot serve on {a.host}:{a.port}: {e.strerror or e}", file=sys.stderr)
                return 1
            return 0
        return asyncio.run(_generate_once(a, config))
    except EngineError as e:
        print(f"error ({e.code}): {e.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
