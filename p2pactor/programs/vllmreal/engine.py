"""One real vLLM 0.33.0 engine, as a process driven over its standard input.

Run by :class:`~p2pactor.programs.vllmreal.client.EngineProcess` as ``python -m
p2pactor.programs.vllmreal.engine OPTIONS_JSON``. It builds ``vllm.LLM`` on
vLLM's CPU platform (token-id prompts, no tokenizer, eager, float32) with
``OffloadingConnector`` and ``TieringOffloadingSpec`` and the secondary tier the
options name, warms it up (and, for a p2pactor tier with seed peers, waits for
their whole summaries), answers ``{"ready": ...}``, then one answer per
command line::

    {"cmd": "generate", "prompts": [[ids]], "kv": [params | null], "max_tokens": N}
        -> {"tokens": [[ids]], "logprobs": [[float]], "ttft": [s], "cached": [n], "seconds": s}
    {"cmd": "metrics"}  -> {"metrics": {"name{label=value}": value}}  (vLLM's own, with
                           every figure a p2pactor tier's node counted so far)
    {"cmd": "quit"}     -> {"left": [files of its own left in /dev/shm]}, then it exits

``kv`` is each prompt's ``kv_transfer_params`` (``remote_kv_source`` and the
like). Answers go to a private copy of the standard output, one JSON line each
after ``@engine ``; vLLM's, NIXL's and UCX's logs go to the standard error.
Everything it opens is on 127.0.0.1. SIGTERM ends it as a normal exit, so
vLLM's finalizers stop its engine core and remove its offload region.
"""

from __future__ import annotations

import gc
import glob
import json
import os
import signal
import sys
import time
from typing import Any, TextIO

__all__ = ["ENV", "PREFIX", "main"]

PREFIX = "@engine "
"""What starts every answer line."""

ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_LOOPBACK_IP": "127.0.0.1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "UCX_NET_DEVICES": "lo",
    "NIXL_LOG_LEVEL": "WARN",
    # vLLM compiles its logprobs kernel with torch.compile even when eager
    # (seconds at the first request with logprobs): run it eagerly too.
    "TORCHDYNAMO_DISABLE": "1",
}
"""Set before vLLM is imported (where the caller did not set them)."""


def _claim_stdout() -> TextIO:
    """A private channel for answers; file descriptor 1 (every library's logs) goes to stderr."""
    sys.stdout.flush()
    fd = os.dup(1)
    os.dup2(2, 1)
    return os.fdopen(fd, "w", encoding="utf-8", buffering=1)


_FIGURES_TIMEOUT_S = 30.0
"""How long ``metrics`` waits for a p2pactor tier's figures to reach vLLM (and the
engine, at start, for its seed peers' summaries)."""


def _p2pactor_tiers(llm: Any, tier: dict[str, Any] | None) -> list[Any] | None:
    """The p2pactor tiers of the engine (``tier`` is its ``secondary_tiers`` entry).

    None if the entry names p2pactor's tier but vLLM's engine core runs in
    another process (``inproc`` off), out of reach.
    """
    if tier is None or tier.get("module_path") != "p2pactor.adapters.vllm":
        return []
    from p2pactor.adapters.vllm import P2PActorTierManager  # noqa: PLC0415 - after ENV

    core = getattr(llm.llm_engine.engine_core, "engine_core", None)  # InprocClient's
    if core is None:
        return None
    manager = core.scheduler.connector.connector_scheduler.manager
    return [t for t in manager.secondary_tiers if isinstance(t, P2PActorTierManager)]


def _published(tier: Any) -> bool:
    """Whether the tier's node thread has published every figure its node counted so far.

    The node counts on its own thread and publishes for ``get_stats`` every
    0.1 s; the figures are read on that thread too.
    """
    import trio  # noqa: PLC0415

    from p2pactor.adapters._vllm_thread import SERIES  # noqa: PLC0415

    runner = tier._runner
    surface = runner.surface

    def counted() -> dict[str, float]:
        return {k: v for k, v in surface.metrics.totals().items() if k in SERIES}

    return bool(runner.totals == trio.from_thread.run_sync(counted, trio_token=runner._token))


def _has_seed_summaries(tier: Any) -> bool:
    """Whether the tier's node holds a whole summary of each of its seed peers, all applied.

    Until then a request naming no source finds nothing at them. Read on the
    node's thread, which applies the summaries.
    """
    import trio  # noqa: PLC0415

    node = tier.node
    seeds = node.config.seed_peers

    def synced() -> bool:
        index = node.directory.index
        positions = [index.position(peer) for peer in seeds]
        return not index.pending and all(p is not None and p[2] for p in positions)

    return bool(trio.from_thread.run_sync(synced, trio_token=tier._runner._token))


def _reported(tier: Any) -> bool:
    """Whether ``get_stats`` has handed over the figures last published."""
    return bool(tier._runner._reported is tier._runner.totals)


def _metrics(llm: Any) -> dict[str, float]:
    """VLLM's own figures (this process's registry), one number per series."""
    from vllm.v1.metrics.reader import Counter, Gauge, Histogram, Vector  # noqa: PLC0415

    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        labels = {k: v for k, v in metric.labels.items() if k not in ("engine", "model_name")}
        name = metric.name
        if labels:
            name += "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"
        if isinstance(metric, Counter | Gauge):
            out[name] = float(metric.value)
        elif isinstance(metric, Histogram):
            out[name + ":count"] = float(metric.count)
            out[name + ":sum"] = float(metric.sum)
        elif isinstance(metric, Vector):
            out[name] = float(sum(metric.values))
    return out


class _Engine:
    def __init__(self, options: dict[str, Any]) -> None:
        from vllm import LLM  # noqa: PLC0415 - after ENV

        tier = options.get("tier")
        kv_config: dict[str, Any] = {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "engine_id": options["engine_id"],
            "kv_connector_extra_config": {
                "spec_name": "TieringOffloadingSpec",
                "cpu_bytes_to_use": int(options["cpu_bytes"]),
                "tier_poll_interval_s": 0.001,
                "secondary_tiers": [tier] if tier else [],
            },
        }
        started = time.perf_counter()
        self.llm = LLM(
            model=options["model"],
            skip_tokenizer_init=True,
            enforce_eager=True,
            dtype="float32",
            block_size=int(options.get("block_size", 32)),
            max_model_len=int(options.get("max_model_len", 2048)),
            max_num_seqs=int(options.get("max_num_seqs", 8)),
            seed=0,
            disable_log_stats=False,
            kv_transfer_config=kv_config,
            **({"distributed_executor_backend": "uni"} if options.get("inproc") else {}),
        )
        self.startup_s = time.perf_counter() - started
        self.engine_id = str(options["engine_id"])
        self.block = int(options.get("block_size", 32))
        self._tiers = _p2pactor_tiers(self.llm, options.get("tier"))
        # The first request with logprobs costs seconds once per process; one
        # shorter than a block stores nothing and looks nothing up.
        self._run([[5] * (self.block // 2)], [None], 2)
        # Ready for requests naming no source: the seed peers' summaries are in.
        deadline = time.monotonic() + _FIGURES_TIMEOUT_S
        while not all(_has_seed_summaries(t) for t in self._tiers or ()):
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"no whole summary from a seed peer within {_FIGURES_TIMEOUT_S:g} s"
                )
            time.sleep(0.01)

    def _run(self, prompts: list[list[int]], kv: list[Any], max_tokens: int) -> list[Any]:
        from vllm import SamplingParams  # noqa: PLC0415
        from vllm.inputs import TokensPrompt  # noqa: PLC0415

        params = [
            SamplingParams(
                temperature=0.0,
                max_tokens=max_tokens,
                ignore_eos=True,
                logprobs=1,
                extra_args=None if p is None else {"kv_transfer_params": p},
            )
            for p in kv
        ]
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        return list(self.llm.generate(inputs, params, use_tqdm=False))

    def generate(self, prompts: list[list[int]], kv: list[Any], max_tokens: int) -> dict[str, Any]:
        started = time.perf_counter()
        outs = self._run(prompts, kv, max_tokens)
        seconds = time.perf_counter() - started
        return {
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "logprobs": [
                [max(lp.values(), key=lambda x: x.logprob).logprob for lp in o.outputs[0].logprobs]
                for o in outs
            ],
            "ttft": [
                None if o.metrics is None else float(o.metrics.first_token_latency) for o in outs
            ],
            "cached": [o.num_cached_tokens for o in outs],
            "seconds": seconds,
        }

    def metrics(self) -> dict[str, Any]:
        # A p2pactor tier's figures reach vLLM's registry through get_stats at a
        # scheduler step, from what its node's thread last published: wait until
        # that is everything the node counted, then take a step that stores
        # nothing, until get_stats has handed it over.
        tiers = self._tiers
        if tiers is None:
            raise RuntimeError("metrics waits for p2pactor's figures only in inproc engines")
        deadline = time.monotonic() + _FIGURES_TIMEOUT_S
        while True:
            if all(_published(t) for t in tiers):
                self._run([[7] * (self.block // 2)], [None], 1)
                if all(_reported(t) for t in tiers):
                    return {"metrics": _metrics(self.llm)}
            else:
                time.sleep(0.01)
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"a p2pactor tier's figures did not reach vLLM within {_FIGURES_TIMEOUT_S:g} s"
                )

    def quit(self) -> dict[str, Any]:
        # LLM has no close() in 0.33.0: what its finalizer calls.
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()
        # vLLM's offload region: /dev/shm/vllm_offload_<engine_id>.mmap
        return {"left": sorted(glob.glob(f"/dev/shm/*{self.engine_id}*"))}  # noqa: S108


def main() -> None:
    """Build the engine from ``sys.argv[1]`` (JSON), then answer commands until ``quit``."""
    for name, value in ENV.items():
        os.environ.setdefault(name, value)
    options = json.loads(sys.argv[1])
    if options.get("inproc"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    answers = _claim_stdout()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    def answer(obj: dict[str, Any]) -> None:
        answers.write(PREFIX + json.dumps(obj) + "\n")

    engine = _Engine(options)
    import vllm  # noqa: PLC0415

    answer({"ready": True, "startup_s": engine.startup_s, "vllm": vllm.__version__})
    for line in sys.stdin:
        if not line.strip():
            continue
        msg = json.loads(line)
        cmd = msg.get("cmd")
        if cmd == "generate":
            answer(engine.generate(msg["prompts"], msg["kv"], int(msg.get("max_tokens", 4))))
        elif cmd == "metrics":
            answer(engine.metrics())
        elif cmd == "quit":
            answer(engine.quit())
            return
        else:
            answer({"error": f"unknown command {cmd!r}"})
    engine.quit()  # the driver went away


if __name__ == "__main__":
    main()
