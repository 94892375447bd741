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
learned out of sample, as trainer `tide` learns them: a calibration run (one batch size) feeds the
trainer's online estimator (`StageTimer`) pass by pass; its rates then predict runs of another batch size
(`--test-mb-size`, `--test-micro-batches`) under every arrival pattern, in every mode. The whole
calibrate-then-predict round repeats (`--repeats`, default 3) and the table reports each repeat's error and
how often the cost model's choice (`choose_mode`) was the measured best. `--json PATH` writes every repeat.
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
    from verl_tide.ra2p.cost import colocated_cost, decoupled_cost, split_cost
    from verl_tide.ra2p.stock_cost import global_batch_cost, streaming_swap_cost

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


def calibrate_online(args, w: Colocated, data, timer) -> None:
    """Feed `timer` (the trainer's `StageTimer`: exponentially smoothed per-token rates) each pass of a short
    colocated run, as trainer `tide` feeds it from a running job: Ref and Actor passes with their tokens, and
    each swap. The first pass is a warm-up and not observed."""
    tokens = args.mb_size * args.seq
    w.swap("actor")
    for i in range(args.calib + 1):
        ids = data[i % len(data)]
        timed = {}
        s = time.perf_counter(); w.swap("ref"); timed["swap"] = time.perf_counter() - s
        s = time.perf_counter(); ref = w.ref_forward(ids); timed["ref"] = time.perf_counter() - s
        s = time.perf_counter(); w.swap("actor"); swap_back = time.perf_counter() - s
        s = time.perf_counter(); logp = w.actor_forward(ids); w.sync(); timed["act_f"] = time.perf_counter() - s
        s = time.perf_counter(); w.actor_backward(logp, ref); timed["act_b"] = time.perf_counter() - s
        if i == 0:
            continue
        for stage in ("ref", "act_f", "act_b"):
            timer.observe(stage, tokens, timed[stage])
        timer.observe("swap", 0, timed["swap"])
        timer.observe("swap", 0, swap_back)


def measure_patterns(args, w: Colocated, data, times, names=None) -> list[dict]:
    """Every mode of every arrival pattern, measured, beside the cost model's prediction from `times`."""
    from verl_tide.ra2p.cost import best_split, choose_mode

    t_act = times.t_act_f + times.t_act_b
    rows = []
    for name, arrivals in patterns(args.micro_batches, t_act).items():
        if names is not None and name not in names:
            continue
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
    return rows


def error_summary(repeats: list[list[dict]]) -> dict:
    """Per pattern and mode: the relative prediction error (predicted / measured - 1) in each repeat, and how
    often the cost model's choice was the measured best of the modes it chooses between."""
    out: dict = {"errors": {}, "choice_was_best": 0, "choices": 0, "chosen_vs_best": []}
    for rows in repeats:
        for r in rows:
            for mode, m in r["modes"].items():
                out["errors"].setdefault(r["name"], {}).setdefault(mode, []).append(
                    m["predicted_s"] / m["measured_s"] - 1)
            best = min(r["modes"][m]["measured_s"] for m in ("colocated", "decoupled", "split"))
            chosen = r["modes"][r["chosen"]]["measured_s"]
            out["choices"] += 1
            out["choice_was_best"] += chosen <= best * 1.0001
            out["chosen_vs_best"].append(chosen / best)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--mb-size", type=int, default=2, help="rows per micro-batch of the calibration run")
    ap.add_argument("--micro-batches", type=int, default=8, help="micro-batches a step in the calibration run")
    ap.add_argument("--test-mb-size", type=int, default=3, help="rows per micro-batch of the predicted runs")
    ap.add_argument("--test-micro-batches", type=int, default=8, help="micro-batches a step, predicted runs")
    ap.add_argument("--calib", type=int, default=4, help="passes of the calibration run (after a warm-up)")
    ap.add_argument("--repeats", type=int, default=3, help="calibrate-then-predict rounds (the spread)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (CPU)")
    ap.add_argument("--json")
    args = ap.parse_args()

    import copy

    import torch

    from verl_tide.boundary.planner import StageRates
    from verl_tide.ra2p.cost import StageTimer

    torch.set_num_threads(args.threads)
    test = copy.copy(args)
    test.mb_size, test.micro_batches = args.test_mb_size, args.test_micro_batches
    test_data = batches(test)
    repeats, calibrations = [], []
    for rep in range(args.repeats):
        # Out of sample: the rates come from one run (the calibration batch size), as the trainer learns them
        # online, and predict runs of another batch size and every arrival pattern.
        w = Colocated(args)
        timer = StageTimer()
        calibrate_online(args, w, batches(args), timer)
        rates = StageRates.from_timer(timer)
        times = rates.stage_times(test.mb_size * test.seq)
        calibrations.append(asdict(rates))
        print(f"repeat {rep + 1}/{args.repeats}: rates learned online (s/token) ref {rates.ref:.2e} act_f "
              f"{rates.act_f:.2e} act_b {rates.act_b:.2e}, swap {rates.swap_s:.4f}s; predicting {test.micro_batches} "
              f"micro-batches of {test.mb_size} rows", flush=True)
        repeats.append(measure_patterns(test, w, test_data, times))
    summary = error_summary(repeats)
    print()
    print(f"{'pattern':<11} {'mode':<15} {'error per repeat (predicted/measured - 1)':<44} mean")
    worst = 0.0
    for name, by_mode in summary["errors"].items():
        for mode, errs in by_mode.items():
            worst = max(worst, max(abs(e) for e in errs))
            print(f"{name:<11} {mode:<15} {'  '.join(f'{e:+7.1%}' for e in errs):<44} {statistics.mean(errs):+7.1%}")
    ratios = summary["chosen_vs_best"]
    print(f"worst |error| {worst:.1%}; the cost model's choice was the measured best in {summary['choice_was_best']} "
          f"of {summary['choices']} steps (chosen/best: median {statistics.median(ratios):.3f}, max {max(ratios):.3f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "hardware": hardware(args.device),
                       "date": time.strftime("%Y-%m-%d"),
                       "model": {"layers": args.layers, "hidden": args.hidden, "seq": args.seq},
                       "calibration": {"mb_size": args.mb_size, "micro_batches": args.micro_batches,
                                       "passes": args.calib, "estimator": "StageTimer (online, smoothed)"},
                       "predicted": {"mb_size": test.mb_size, "micro_batches": test.micro_batches},
                       "rates_per_repeat": calibrations, "repeats": repeats, "worst_abs_error": worst,
                       "choice_was_best": summary["choice_was_best"], "choices": summary["choices"],
                       "errors": summary["errors"]}, f, indent=2)


if __name__ == "__main__":
    main()
