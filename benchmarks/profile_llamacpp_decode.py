"""Where llama.cpp's decode step goes, op by op: the peer's side of ``profile_moe_decode.py``.

    PYTHONPATH=/path/to/llama-cpp-python python benchmarks/profile_llamacpp_decode.py -m /tmp/qwen3moe-8.gguf

llama.cpp (llama-cpp-python, never a dependency) runs a ``--prompt``-token prefill, then
``--steps`` decode steps, each fed a random token as ``profile_moe_decode.py`` feeds ours. The
graph's evaluation callback (``cb_eval``) asks for every node, so the scheduler computes the graph
node by node and calls back after each: the time from one call back to the next is that node's
compute (and its share of the threads' barrier). The nodes are summed by op, matrix products by
their weight's graph name (``Qcur``, ``ffn_moe_gate``, ``result_output``; llama.cpp names the
attention output's product ``node_N``). The callbacks themselves cost the step ~5-10 %, so read the
split, not the total, against ``bench``'s tok/s. Prints the step's median wall time and the ops'
ms a step, largest first.
"""

from __future__ import annotations

import argparse
import collections
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--top", type=int, default=20)
    a = ap.parse_args()

    import llama_cpp as L

    from llamatrace.peers import llamacpp
    llamacpp._silence_logs(L)
    L.llama_backend_init()
    ggml = llamacpp._ggml_base()
    model = L.llama_model_load_from_file(a.model.encode(), L.llama_model_default_params())
    if not model:
        raise SystemExit(f"llama.cpp cannot load {a.model}")
    params = L.llama_context_default_params()
    params.n_ctx = params.n_batch = params.n_ubatch = a.prompt + a.steps + 8
    params.n_threads = params.n_threads_batch = a.threads
    nodes: list[tuple[str, str, float]] = []
    timing = [False]
    last = [0.0]

    def on_node(t, ask, user_data) -> bool:
        if ask:
            return True
        now = time.perf_counter()
        if timing[0]:
            name = (ggml.ggml_get_name(t) or b"").decode()
            op = (ggml.ggml_op_desc(t) or b"").decode()
            nodes.append((name, op, now - last[0]))
        last[0] = time.perf_counter()
        return True

    callback = L.ggml_backend_sched_eval_callback(on_node)
    params.cb_eval = callback
    ctx = L.llama_init_from_model(model, params)

    def run(ids: list[int], pos: int) -> None:
        batch = L.llama_batch_init(len(ids), 0, 1)
        for i, tok in enumerate(ids):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos + i, 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = i == len(ids) - 1
        batch.n_tokens = len(ids)
        last[0] = time.perf_counter()
        try:
            if L.llama_decode(ctx, batch) != 0:
                raise SystemExit("llama_decode failed")
        finally:
            L.llama_batch_free(batch)

    run([1 + i % 1000 for i in range(a.prompt)], 0)
    rng = np.random.default_rng(0)
    walls = []
    timing[0] = True
    for s in range(a.steps):
        t0 = time.perf_counter()
        run([int(rng.integers(1000, 20000))], a.prompt + s)
        walls.append(time.perf_counter() - t0)
    by_op: dict[str, float] = collections.defaultdict(float)
    for name, op, dt in nodes:
        by_op[f"{op} {name.split('-')[0]}" if op in ("MUL_MAT", "MUL_MAT_ID") else op] += dt
    print(f"{a.model}: llama.cpp, {a.threads} threads, {a.steps} steps; step median {np.median(walls) * 1e3:.2f} ms "
          f"(callbacks included), ops {sum(by_op.values()) / a.steps * 1e3:.2f} ms")
    for key, total in sorted(by_op.items(), key=lambda kv: -kv[1])[:a.top]:
        print(f"{key:40s} {total / a.steps * 1e3:8.3f} ms")
    L.llama_free(ctx)
    L.llama_model_free(model)


if __name__ == "__main__":
    main()
