"""RA2P per-step time: measured in real worker processes vs the Appendix A cost model.

One training step consumes M micro-batches that become ready over time (arrival patterns below).
The Ref model (forward only) and the Actor (forward + backward, KL applied in backward) are the
same architecture (random init, `--layers/--hidden`). Four ways to run the step, each for real:

- global_wait: wait for the whole batch; swap in Ref, all Ref forwards; swap in Actor, all updates.
- streaming_swap: per micro-batch as it arrives: swap in Ref, forward, swap in Actor, update
  (StreamRL-style streaming with Ref and Actor sharing one device).
- colocated: RA2P colocated mode: aggregate every ready micro-batch per swap (one Ref load per burst).
- decoupled: RA2P decoupled mode: Ref on its own worker process computes ref log-probs as data
  arrives and streams them to the Actor process, whose forward starts without them (deferred KL).
- split: RA2P split mode: colocated aggregation, but a Ref worker process scores a share of each
  burst's rows (from its end; the share from `best_split`) while the Actor process runs the rest
  between its two swaps; a micro-batch's backward waits for the worker's rows (deferred KL).
  split_half: the same at a fixed share of one half (checks the cost model away from its optimum).

A "swap" loads the other model's weights into the one device-resident module (a real copy of every
parameter, from a pinned host copy on GPU). Stage times (t_ref, t_act_f, t_act_b, t_swap) are
measured first and fed to the cost model (`verl_tide.ra2p.cost`); the chosen mode is what
`choose_mode` picks from them. Prints a table; `--json PATH` writes
{"patterns": [{"name", "chosen", "modes": {MODE: {"measured_s", "predicted_s"}}}], "stage_times": ...}.
CPU: `python benchmarks/ra2p_step.py`. GPU (one device; decoupled then shares it between two
processes; a 0.70B random-init Llama, torch and transformers only, no verl, no network):
`bash benchmarks/ra2p_step_gpu.sh` (writes benchmarks/results/ra2p_step_<gpu name>.json).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from dataclasses import asdict

MODES = ("global_wait", "streaming_swap", "colocated", "decoupled", "split", "split_half")


def build(args, seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
                      num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
                      num_key_value_heads=max(1, args.hidden // 128), max_position_embeddings=args.seq + 8)
    model = LlamaForCausalLM(cfg).to(args.device)
    model.config.use_cache = False
    return model


def batches(args):
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, args.vocab, (args.mb_size, args.seq), generator=g) for _ in range(args.micro_batches)]


def token_logprobs(model, ids):
    import torch

    logits = model(input_ids=ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


class Colocated:
    """One device-resident module; Ref and Actor weights live on the host and are swapped in."""

    def __init__(self, args):
        import torch

        self.args, self.torch = args, torch
        self.module = build(args, seed=1)
        pin = args.device != "cpu"
        self.host = {"actor": {k: (v.detach().to("cpu").pin_memory() if pin else v.detach().clone())
                               for k, v in self.module.state_dict().items()}}
        ref = build(args, seed=2).state_dict()
        self.host["ref"] = {k: (v.to("cpu").pin_memory() if pin else v.clone()) for k, v in ref.items()}
        self.resident = "actor"
        self.opt = torch.optim.SGD(self.module.parameters(), lr=1e-6)

    def sync(self):
        if self.args.device != "cpu":
            self.torch.cuda.synchronize()

    def swap(self, to: str):
        if self.resident == to:
            return
        if self.resident == "actor":  # keep the updated actor weights
            self.host["actor"] = {k: v.detach().to("cpu", copy=True) for k, v in self.module.state_dict().items()}
        self.module.load_state_dict(self.host[to])
        self.resident = to
        self.sync()

    def ref_forward(self, ids):
        with self.torch.no_grad():
            out = token_logprobs(self.module, ids.to(self.args.device))
        self.sync()
        return out

    def actor_forward(self, ids):
        return token_logprobs(self.module, ids.to(self.args.device))

    def actor_backward(self, logp, ref):
        loss = -logp.mean() + 0.01 * (logp - ref.to(logp.device)).mean()  # the KL term, applied in backward
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sync()


def calibrate(args, w: Colocated, data) -> dict:
    """Median stage times over a few repetitions (after a warm-up)."""
    t = {"ref": [], "act_f": [], "act_b": [], "swap": []}
    w.swap("actor")
    for i in range(args.calib + 1):
        ids = data[i % len(data)]
        s = time.perf_counter(); w.swap("ref"); t["swap"].append(time.perf_counter() - s)
        s = time.perf_counter(); ref = w.ref_forward(ids); t["ref"].append(time.perf_counter() - s)
        s = time.perf_counter(); w.swap("actor"); t["swap"].append(time.perf_counter() - s)
        s = time.perf_counter(); logp = w.actor_forward(ids); w.sync(); t["act_f"].append(time.perf_counter() - s)
        s = time.perf_counter(); w.actor_backward(logp, ref); t["act_b"].append(time.perf_counter() - s)
    return {k: statistics.median(v[1:] if len(v) > 2 else v) for k, v in t.items()}


def wait_until(start: float, at: float) -> None:
    delay = start + at - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def ready_bursts(order: list[int], arrivals, start: float):
    """Ready-batch aggregation's bursts: wait for the next micro-batch, then take every one ready by then."""
    j = 0
    while j < len(order):
        wait_until(start, arrivals[order[j]])
        now = time.perf_counter() - start
        k = 1
        while j + k < len(order) and arrivals[order[j + k]] <= now:
            k += 1
        yield order[j:j + k]
        j += k


def run_colocated_mode(mode: str, args, w: Colocated, data, arrivals) -> float:
    w.swap("actor")
    order = sorted(range(len(data)), key=lambda i: arrivals[i])
    start = time.perf_counter()
    if mode == "global_wait":
        wait_until(start, max(arrivals))
        w.swap("ref")
        refs = [w.ref_forward(data[i]) for i in order]
        w.swap("actor")
        for i, ref in zip(order, refs):
            w.actor_backward(w.actor_forward(data[i]), ref)
    elif mode == "streaming_swap":
        for i in order:
            wait_until(start, arrivals[i])
            w.swap("ref")
            ref = w.ref_forward(data[i])
            w.swap("actor")
            w.actor_backward(w.actor_forward(data[i]), ref)
    elif mode == "colocated":
        for burst in ready_bursts(order, arrivals, start):
            w.swap("ref")
            refs = [w.ref_forward(data[i]) for i in burst]
            w.swap("actor")
            for i, ref in zip(burst, refs):
                w.actor_backward(w.actor_forward(data[i]), ref)
    else:
        raise ValueError(mode)
    return time.perf_counter() - start


def _ref_worker(args, arrivals, start_at, ready, out_q):
    import torch

    torch.set_num_threads(args.threads)
    model = build(args, seed=2)
    data = batches(args)
    with torch.no_grad():  # warm-up, before the step's clock starts
        token_logprobs(model, data[0].to(args.device))
    ready.set()
    while not start_at.value:
        time.sleep(0.001)
    for i in sorted(range(len(data)), key=lambda i: arrivals[i]):
        wait_until(start_at.value, arrivals[i])
        with torch.no_grad():
            # numpy, not a tensor: torch would share the storage through this process, which exits first
            out_q.put((i, token_logprobs(model, data[i].to(args.device)).cpu().numpy()))


def run_decoupled(args, data, arrivals) -> float:
    """Ref in its own process streams ref log-probs; the Actor (this process) runs forward as soon as a
    micro-batch is ready and applies the KL term in backward once the ref log-probs are there."""
    import torch

    ctx = mp.get_context("spawn")
    start_at, ready, out_q = ctx.Value("d", 0.0), ctx.Event(), ctx.Queue()
    ref_proc = ctx.Process(target=_ref_worker, args=(args, arrivals, start_at, ready, out_q), daemon=True)
    ref_proc.start()
    actor = Colocated(args)  # Actor resident; the Ref weights are never loaded here
    warm = actor.actor_forward(data[0]); actor.actor_backward(warm, warm.detach())
    if not ready.wait(timeout=600):  # the Ref process has built and warmed up its model
        raise RuntimeError("Ref worker did not start")
    order = sorted(range(len(data)), key=lambda i: arrivals[i])
    refs: dict[int, torch.Tensor] = {}
    start = time.perf_counter()
    start_at.value = start
    for i in order:
        wait_until(start, arrivals[i])
        logp = actor.actor_forward(data[i])  # deferred KL: no ref needed for the forward graph
        while i not in refs:
            j, r = out_q.get()
            refs[j] = torch.from_numpy(r)
        actor.actor_backward(logp, refs.pop(i))
    elapsed = time.perf_counter() - start
    ref_proc.join(timeout=60)
    return elapsed


def _split_ref_worker(args, ready, in_q, out_q):
    """The split mode's Ref rank: scores the rows it is sent, in order, until told to stop (None)."""
    import torch

    torch.set_num_threads(args.threads)
    model = build(args, seed=2)
    data = batches(args)
    with torch.no_grad():
        token_logprobs(model, data[0].to(args.device))
    ready.set()
    while (item := in_q.get()) is not None:
        i, lo, hi = item
        with torch.no_grad():
            out_q.put((i, lo, token_logprobs(model, data[i][lo:hi].to(args.device)).cpu().numpy()))


def run_split(args, w: Colocated, data, arrivals, share: float) -> float:
    """Colocated aggregation with a share of every burst's Ref rows on a Ref worker process: the worker's rows
    are sent when the burst starts (from the burst's end), the Actor process swaps in Ref for the rest, swaps
    back and trains each micro-batch, its backward taking the worker's rows when they are there."""
    import torch

    ctx = mp.get_context("spawn")
    ready, in_q, out_q = ctx.Event(), ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_split_ref_worker, args=(args, ready, in_q, out_q), daemon=True)
    proc.start()
    if not ready.wait(timeout=600):
        raise RuntimeError("split Ref worker did not start")
    w.swap("actor")
    rows = args.mb_size
    order = sorted(range(len(data)), key=lambda i: arrivals[i])
    got: dict[tuple[int, int], torch.Tensor] = {}
    start = time.perf_counter()
    for burst in ready_bursts(order, arrivals, start):
        k = len(burst)
        # the worker's rows: the burst's last `remote` rows; the Actor process keeps at least one (share < 1)
        remote = min(round(share * k * rows), k * rows - 1)
        local_rows = k * rows - remote
        pieces: dict[int, list[tuple[int, int, bool]]] = {}  # micro-batch -> (lo, hi, on the worker)
        for n, i in enumerate(burst):
            cut = min(rows, max(0, local_rows - n * rows))  # rows of this micro-batch the Actor process scores
            pieces[i] = [(0, cut, False)] if cut else []
            if cut < rows:
                pieces[i].append((cut, rows, True))
                in_q.put((i, cut, rows))
        w.swap("ref")
        for i in burst:
            for lo, hi, remote_piece in pieces[i]:
                if not remote_piece:
                    got[(i, lo)] = w.ref_forward(data[i][lo:hi])
        w.swap("actor")
        for i in burst:
            logp = w.actor_forward(data[i])
            while any((i, lo) not in got for lo, _, _ in pieces[i]):
                mb, lo, r = out_q.get()
                got[(mb, lo)] = torch.from_numpy(r)
            ref = torch.cat([got.pop((i, lo)).to(logp.device) for lo, _, _ in pieces[i]])
            w.actor_backward(logp, ref)
    elapsed = time.perf_counter() - start
    in_q.put(None)
    proc.join(timeout=60)
    return elapsed


def patterns(m: int, t_act: float) -> dict[str, list[float]]:
    return {
        "all_ready": [0.0] * m,
        "steady": [0.0] + [1.25 * t_act * (i + 1) for i in range(m - 1)],  # rollout a bit slower than training
        "bursty": [((i // 4) * 5.0 * t_act) for i in range(m)],  # bursts of 4
        "half_ready": [0.0] * (m // 2) + [0.6 * t_act * (i + 1) for i in range(m - m // 2)],
    }


def predict(mode: str, arrivals, times, m: int, share: float = 0.0) -> float:
    from verl_tide.ra2p.cost import (colocated_cost, decoupled_cost, global_batch_cost, split_cost,
                                     streaming_swap_cost)

    if mode in ("split", "split_half"):  # the Ref worker at the measured Ref speed (same device, own process)
        return split_cost(arrivals, times, times.t_ref, share, max_aggregate=m)
    if mode == "global_wait":
        return global_batch_cost(arrivals, times)
    if mode == "streaming_swap":
        return streaming_swap_cost(arrivals, times)
    if mode == "colocated":
        return colocated_cost(arrivals, times, max_aggregate=m)
    return decoupled_cost(arrivals, times, actor_ranks=1)


def hardware(device: str) -> str:
    """What the numbers were measured on, for the results file."""
    import platform

    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch thread(s)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--mb-size", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--calib", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (CPU)")
    ap.add_argument("--json")
    args = ap.parse_args()

    import torch

    from verl_tide.ra2p.cost import StageTimes, best_split, choose_mode

    torch.set_num_threads(args.threads)
    data = batches(args)
    w = Colocated(args)
    st = calibrate(args, w, data)
    times = StageTimes(t_ref=st["ref"], t_act_f=st["act_f"], t_act_b=st["act_b"], t_swap=st["swap"])
    t_act = times.t_act_f + times.t_act_b
    print(f"stage times (s): ref {times.t_ref:.3f}  act_f {times.t_act_f:.3f}  act_b {times.t_act_b:.3f}  "
          f"swap {times.t_swap:.3f}", flush=True)
    rows = []
    for name, arrivals in patterns(args.micro_batches, t_act).items():
        choice = choose_mode(arrivals, times, actor_ranks=1, max_aggregate=args.micro_batches, hysteresis=0.0,
                             split_ref_t_ref=times.t_ref)
        share = best_split(arrivals, times, times.t_ref, args.micro_batches)[0]
        modes = {}
        for mode in MODES:
            if mode == "decoupled":
                measured = run_decoupled(args, data, arrivals)
            elif mode in ("split", "split_half"):
                measured = run_split(args, w, data, arrivals, share if mode == "split" else 0.5)
            else:
                measured = run_colocated_mode(mode, args, w, data, arrivals)
            modes[mode] = {"measured_s": measured,
                           "predicted_s": predict(mode, arrivals, times, args.micro_batches,
                                                  share if mode == "split" else 0.5)}
            print(f"  {name:<11} {mode:<15} measured {measured:7.3f}s  predicted {modes[mode]['predicted_s']:7.3f}s",
                  flush=True)
        modes["split"]["share"], modes["split_half"]["share"] = share, 0.5
        rows.append({"name": name, "chosen": choice.mode.value, "modes": modes})
    print()
    print(f"{'pattern':<11} {'chosen':<10} " + " ".join(f"{m:>22}" for m in MODES) + "   chosen/best  vs streaming")
    for r in rows:
        cells = " ".join(f"{r['modes'][m]['measured_s']:>9.2f} ({r['modes'][m]['predicted_s']:>8.2f})" for m in MODES)
        best = min(r["modes"][m]["measured_s"] for m in ("colocated", "decoupled", "split"))
        chosen = r["modes"][r["chosen"]]["measured_s"]
        gain = 1 - chosen / r["modes"]["streaming_swap"]["measured_s"]
        print(f"{r['name']:<11} {r['chosen']:<10} {cells}   {chosen / best:>10.3f}  {gain:>+10.1%}")
    print("(cells: measured s (predicted s))")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "hardware": hardware(args.device),
                       "model": {"layers": args.layers, "hidden": args.hidden, "seq": args.seq},
                       "micro_batches": args.micro_batches, "stage_times": asdict(times), "patterns": rows}, f,
                      indent=2)


if __name__ == "__main__":
    main()
