"""Daemon throughput: answers/s and round-trip percentiles of ``edgevlm serve`` under closed-loop clients.

    .venv/bin/python bench/daemon_throughput.py [--model DIR] [--device cpu|cuda] [--profile h100]
        [--clients 1,8,32] [--duration-s 10] [--warmup-s 2] [--max-new-tokens 16] [--rows N]
        [--batching auto|on|off] [--threads N] [--quality 90] [--py-spy DIR [--py-spy-gil]] [--daemon-log FILE]
        [--front-processes auto,0,2,4] [--members 2]

Starts a private mosquitto with the project's broker config (:class:`edgevlm.daemon.demo_processes.Broker`,
``set_tcp_nodelay true``) and the real daemon in its own process (``python -m edgevlm.cli serve --config
FILE``: the model on ``--device``, ``--profile`` for a CUDA device, e.g. ``h100`` = continuous batching over
32 KV-cache rows). For each client count, that many SDK clients (:class:`edgevlm.client.Client`), **each in
its own process** (multiprocessing, spawn), ask the demo evaluation questions about their inline 384x288
JPEG scene images in a closed loop (the next request as soon as the answer is in) for ``--warmup-s`` (not
counted) then ``--duration-s`` seconds. Reported per client count: answers/s (answers received in the
measured window / window), p50/p99 round trip (client clock: ``Client.ask`` call to return), the daemon's own
``e2e_ms`` p50, mean ``batch_size``, accuracy (answer text == the evaluation set's expected answer), the
operating points the latency controller chose (JSON) and the error count by code. ``--py-spy DIR`` records the daemon process with py-spy during the measured window of
every client count (``DIR/daemon_<n>clients.txt``, collapsed stacks, all threads, non-idle samples) and prints
the share of samples per thread and the top self-time functions of the inference thread; with
``--py-spy-gil`` only the thread holding the GIL is sampled, so the shares say who holds it (a daemon whose
threads together hold it nearly all the time is GIL-bound). ``--daemon-log FILE`` keeps the daemon's log.

Where the round trip goes (``stages``): each answer's ``stats.stages_ms`` (the daemon's clock, ms after
receipt: queued, prepared, dequeued, admitted, first_token, done, replied; see
:func:`edgevlm.daemon.scheduler.request_stages_ms`) is cut into the time of each stage (p50 and mean):
``validate`` (paho's thread: parse, checks, submit), ``prepare`` (image decode + ``Engine.prepare`` on a
prepare thread, queueing for one included), ``to_worker`` (ready until the worker takes it), ``to_group``
(until its prefill group starts), ``prefill`` (to the first token), ``decode`` (to the last), ``reply``
(until the reply thread made the response) and ``outside`` (round trip - replied: the broker both ways, the
daemon's socket before paho reads it, the publish, the client's wake-up). Also reported: the CPU the
window used (the host's 16 or so CPUs, the daemon process, the broker, the client processes: ``cpu``), so
a harness that starves the daemon shows.

Variants, each a fresh daemon (and its own rows in the table): ``--front-processes auto,0,2,4`` runs the
daemon with ``mqtt.front_processes`` = each value (``auto``, the default here: the daemon's default, which
for a CUDA model with continuous batching is up to 4 fronts, the row says how many; 0 = one process; N = N
MQTT front processes that receive,
validate and decode, the daemon's process only schedules and runs the model; see
:mod:`edgevlm.daemon.front`); ``--members M`` (after those) runs M separate one-process daemons on the same
device joined to one pool (``mqtt.pool``), the clients in pool mode (``Client(pool=...)``): the other way to
use more than one Python process. ``cpu`` then also splits the front processes' CPU (``fronts``: the daemon
process's children) from the daemon process's, and ``daemon_cpu_ms_per_answer`` / ``fronts_cpu_ms_per_answer``
give the CPU each spends per answer (the daemon process's is what a GIL-bound daemon runs out of).

Prints a table, whether issue 13's goal at 32 clients is met (:data:`GOAL_ANSWERS_PER_S`,
:data:`GOAL_P99_MS`), then one JSON line. Runs on CPU too (``--device cpu``). CPU batching: ``--device cpu --rows 8
--batching on`` (``--rows`` alone only sizes the KV cache: ``--batching auto`` leaves ``model.continuous_batching``
unset, and the daemon's default for it is off on CPU, whatever the rows; each flag sets one config key as a user
would, so a row of the table is reproduced by the same daemon config).
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEVICE_ID = "bench"
POOL = "benchpool"


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))] if s else 0.0


def _items(n: int, seed: int, quality: int) -> list[tuple[str, str, bytes]]:
    """``(question, expected answer, JPEG bytes)`` of ``n`` demo evaluation items (384x288 scenes)."""
    import cv2

    from edgevlm.runtime.demo import scenes

    out = []
    for it in scenes.eval_set(n, seed):
        ok, buf = cv2.imencode(".jpg", it.image[:, :, ::-1], [cv2.IMWRITE_JPEG_QUALITY, quality])
        if not ok:
            raise RuntimeError("JPEG encoding failed")
        out.append((it.qa.question, it.qa.answer, buf.tobytes()))
    return out


def _client_main(k: int, port: int, items: list[tuple[str, str, bytes]], max_new_tokens: int, go: Any,
                 stop_at: Any, results: Any, pool: str | None = None) -> None:
    """One closed-loop client process: waits for ``go``, asks until ``stop_at`` (wall clock), and puts
    its records ``(t_done, rtt_ms, code, correct, e2e_ms, batch_size, operating_point)`` on ``results``."""
    from edgevlm.client import Client
    from edgevlm.errors import EdgeVLMError

    recs = []
    cpu_s = 0.0
    with Client("127.0.0.1", port, "" if pool else DEVICE_ID, resend_interval_s=None, pool=pool) as c:
        results.put(("ready", k))
        go.wait()
        i = k * 7
        cpu0 = time.process_time()
        while time.time() < stop_at.value:
            q, expected, jpeg = items[i % len(items)]
            i += 1
            t0 = time.perf_counter()
            try:
                a = c.ask(q, image=jpeg, max_new_tokens=max_new_tokens, timeout_s=60)
                rtt = (time.perf_counter() - t0) * 1e3
                recs.append((time.time(), rtt, "OK", a.text.strip() == expected, a.stats.e2e_ms,
                             getattr(a.stats, "batch_size", None) or 1, a.stats.operating_point,
                             getattr(a.stats, "stages_ms", None)))
            except EdgeVLMError as err:
                recs.append((time.time(), (time.perf_counter() - t0) * 1e3, err.code.value, False, None, None, None,
                             None))
        cpu_s = time.process_time() - cpu0  # the whole closed loop (warm-up included), this process
    results.put(("done", k, recs, cpu_s))


STAGES = (("validate", "queued"), ("prepare", "prepared"), ("to_worker", "dequeued"), ("to_group", "admitted"),
          ("prefill", "first_token"), ("decode", "done"), ("reply", "replied"))


def _stage_split(ok: list[tuple]) -> dict[str, dict[str, float]]:
    """p50 / mean ms of each stage of the answers' round trips (see the module doc)."""
    cut: dict[str, list[float]] = collections.defaultdict(list)
    for r in ok:
        stages = r[7]
        if not stages:
            continue
        prev = 0.0
        for name, key in STAGES:
            if key in stages:
                cut[name].append(stages[key] - prev)
                prev = stages[key]
        cut["outside"].append(r[1] - prev)
    return {name: {"p50": round(_pct(v, 0.5), 2), "mean": round(sum(v) / len(v), 2), "n": len(v)}
            for name, v in cut.items()}


def _cpu_ticks(pid: int | None = None) -> float:
    """CPU seconds used so far: the whole host (all CPUs, busy time) or one process (user + system)."""
    hz = os.sysconf("SC_CLK_TCK")
    try:
        if pid is None:
            fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
            ticks = [int(x) for x in fields]
            return (sum(ticks) - ticks[3] - ticks[4]) / hz  # minus idle and iowait
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(stat[11]) + int(stat[12])) / hz
    except (OSError, ValueError, IndexError):
        return float("nan")


GOAL_CLIENTS = 32
GOAL_ANSWERS_PER_S = 600.0
GOAL_P99_MS = 300.0
"""Issue 13's throughput goal (demo model, H200): at 32 clients, answers/s and p99 round trip."""


def _cmdline(pid: int) -> str:
    """A process's command line ("" when it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _children(pid: int) -> list[int]:
    """Ids of the processes whose parent is ``pid`` (a daemon's front processes)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, ValueError, IndexError):
                pass
    return out


def _daemon_config(args: argparse.Namespace, port: int, n_max: int, *, front_processes: int | str = 0,
                   member: int | None = None) -> dict[str, Any]:
    # the clients cycle over --items images: a vision cache would answer repeats from memory, so it is off
    model: dict[str, Any] = {"path": args.model, "device": args.device, "vision_cache_mb": 0}
    if args.threads is not None:
        model["cpu_threads"] = args.threads
    if args.rows is not None:
        model["max_batch_size"] = args.rows
    if args.token_budget is not None:
        model["prefill_token_budget"] = args.token_budget
    if args.batching != "auto":
        model["continuous_batching"] = args.batching == "on"
    cfg: dict[str, Any] = {
        "mqtt": {"host": "127.0.0.1", "port": port, "device_id": DEVICE_ID if member is None else f"{DEVICE_ID}{member}",
                 "front_processes": front_processes, **({"pool": POOL} if member is not None else {})},
        "model": model,
        "defaults": {"max_new_tokens": args.max_new_tokens, "timeout_ms": 60000},
        "queue_max_size": max(64, 2 * n_max),
        "metrics": {"listen": None},
        "telemetry": {"interval_s": None},
        "tegrastats": {"enabled": False},
        "log_level": "WARNING",
    }
    if args.profile is not None:
        cfg["profile"] = args.profile
    return cfg


def _summarize_pyspy(path: Path, top: int = 12) -> dict[str, Any]:
    """Per-thread sample shares and the inference thread's top self-time frames of a py-spy raw
    (collapsed) profile recorded with ``--threads``."""
    per_thread: collections.Counter[str] = collections.Counter()
    self_time: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        thread = frames[0]
        # "thread (0x7f..)" or "process 123:"python ..."" then thread; the thread name when py-spy has it
        name = next((f for f in frames[:2] if f.startswith("thread")), thread)
        per_thread[name] += n
        total += n
        if "edgevlm-inference" in name:
            self_time[frames[-1]] += n
    inf_total = sum(self_time.values())
    return {
        "samples": total,
        "threads": {t: round(c / max(1, total), 3) for t, c in per_thread.most_common(8)},
        "inference_top_self": [(f, round(c / max(1, inf_total), 3)) for f, c in self_time.most_common(top)],
    }


def _run_variant(args: argparse.Namespace, broker: Any, items: list[tuple[str, str, bytes]], counts: list[int],
                 spy: str | None, fronts: int | str, members: int | None) -> list[dict[str, Any]]:
    """Start the daemon(s) of one variant (``fronts`` front processes, or ``members`` pool members),
    run every client count against it, stop it; the results, one per client count."""
    from edgevlm.client import Client
    from edgevlm.daemon.demo_processes import DaemonProcess

    pool = POOL if members is not None else None
    daemons = []
    for m in range(members if members is not None else 1):
        work = Path(tempfile.mkdtemp(prefix="edgevlm-throughput-"))
        cfg = _daemon_config(args, broker.port, max(counts), front_processes=fronts,
                             member=m if members is not None else None)
        daemons.append(DaemonProcess(cfg, work).start())
    results: list[dict[str, Any]] = []
    ctx = mp.get_context("spawn")
    label = f"{members} members" if members is not None else f"{fronts} front processes"
    try:
        t_load = time.monotonic()
        for m, daemon in enumerate(daemons):
            with Client("127.0.0.1", broker.port, DEVICE_ID if pool is None else f"{DEVICE_ID}{m}") as c:
                while not c.wait_online(2.0):
                    daemon.check_alive()
                    if time.monotonic() - t_load > 600:
                        raise RuntimeError("the daemon did not come online in 600 s")
        with Client("127.0.0.1", broker.port, "" if pool else DEVICE_ID, pool=pool) as c:
            for q, _, jpeg in items[:8 * len(daemons)]:  # warm-up through the whole path (CUDA graphs, caches)
                c.ask(q, image=jpeg, max_new_tokens=args.max_new_tokens, timeout_s=120)
        main_pids = [d.proc.pid for d in daemons]
        front_pids = [c for pid in main_pids for c in _children(pid) if "resource_tracker" not in _cmdline(c)]
        if fronts == "auto":  # what the daemon's default resolved to
            label = f"auto ({len(front_pids)} front processes)"
        for n in counts:
            go, stop_at = ctx.Event(), ctx.Value("d", 0.0)
            queue = ctx.Queue()
            procs = [ctx.Process(target=_client_main, args=(k, broker.port, items, args.max_new_tokens, go,
                                                             stop_at, queue, pool), daemon=True) for k in range(n)]
            for p in procs:
                p.start()
            for _ in range(n):
                queue.get(timeout=120)  # every client connected
            t0 = time.time()
            w0, w1 = t0 + args.warmup_s, t0 + args.warmup_s + args.duration_s
            stop_at.value = w1
            go.set()
            spy_proc = None
            spy_path = None
            if args.py_spy and spy is not None:
                Path(args.py_spy).mkdir(parents=True, exist_ok=True)
                tag = f"_f{fronts}" if fronts else (f"_m{members}" if members is not None else "")
                spy_path = Path(args.py_spy) / f"daemon{tag}_{n}clients.txt"
                time.sleep(max(0.0, w0 - time.time()))
                spy_proc = subprocess.Popen(
                    [spy, "record", "--pid", str(main_pids[0]), "--duration", str(int(args.duration_s)),
                     "--rate", "200", "--format", "raw", "--threads", "--nonblocking", "--output", str(spy_path),
                     *(["--gil"] if args.py_spy_gil else [])],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(max(0.0, w0 - time.time()))

            def cpu_now() -> dict[str, float]:
                return {"host": _cpu_ticks(), "daemon": sum(_cpu_ticks(p) for p in main_pids),
                        "fronts": sum(_cpu_ticks(p) for p in front_pids),
                        "broker": _cpu_ticks(broker.proc.pid if broker.proc else None)}

            cpu0 = cpu_now()
            time.sleep(max(0.0, w1 - time.time()))
            cpu1 = cpu_now()
            cpu = {k: round((cpu1[k] - v) / args.duration_s, 2) for k, v in cpu0.items()}  # CPUs busy on average
            recs: list[tuple] = []
            client_cpu_s = 0.0
            for _ in range(n):
                msg = queue.get(timeout=args.warmup_s + args.duration_s + 180)
                recs += msg[2]
                client_cpu_s += msg[3]
            cpu["clients"] = round(client_cpu_s / (args.warmup_s + args.duration_s), 2)
            cpu["host_cpus"] = os.cpu_count()
            for p in procs:
                p.join(10)
            if spy_proc is not None:
                spy_proc.wait(60)
            for daemon in daemons:
                daemon.check_alive()
            window = [r for r in recs if w0 <= r[0] <= w1]
            ok = [r for r in window if r[2] == "OK"]
            codes = collections.Counter(r[2] for r in window if r[2] != "OK")
            res = {
                "variant": label, "front_processes": fronts, "members": members,
                "clients": n, "answers": len(ok), "answers_per_s": round(len(ok) / args.duration_s, 2),
                "p50_ms": round(_pct([r[1] for r in ok], 0.5), 1), "p99_ms": round(_pct([r[1] for r in ok], 0.99), 1),
                "e2e_p50_ms": round(_pct([r[4] for r in ok if r[4] is not None], 0.5), 1),
                "mean_batch_size": round(sum(r[5] for r in ok) / max(1, len(ok)), 2),
                "accuracy": round(sum(r[3] for r in ok) / max(1, len(ok)), 4),
                "errors": dict(codes),
                "operating_points": dict(collections.Counter(r[6] for r in ok).most_common()),
                "stages_ms": _stage_split(ok),
                "cpu": cpu,
                "daemon_cpu_ms_per_answer": round(1e3 * (cpu1["daemon"] - cpu0["daemon"]) / max(1, len(ok)), 3),
                "fronts_cpu_ms_per_answer": round(1e3 * (cpu1["fronts"] - cpu0["fronts"]) / max(1, len(ok)), 3),
                "client_cpu_ms_per_answer": round(1e3 * client_cpu_s / max(1, sum(1 for r in recs if r[2] == "OK")), 3),
            }
            if spy_path is not None and spy_path.exists():
                res["py_spy"] = _summarize_pyspy(spy_path)
            results.append(res)
            print(f"{label}, {n} clients: {res}", file=sys.stderr, flush=True)
    finally:
        for m, daemon in enumerate(daemons):
            daemon.stop()
            if args.daemon_log is not None and daemon.log_path.exists():
                suffix = f".f{fronts}" if fronts else (f".m{members}-{m}" if members is not None else "")
                shutil.copyfile(daemon.log_path, args.daemon_log + suffix)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder (default: the demo model)")
    ap.add_argument("--device", default="cpu", help="model.device: cpu, cuda or cuda:N")
    ap.add_argument("--profile", default=None, help="device profile (e.g. h100: batching over 32 rows on CUDA)")
    ap.add_argument("--clients", default="1,8,32", help="comma-separated client counts")
    ap.add_argument("--duration-s", type=float, default=10.0, help="measured window per client count")
    ap.add_argument("--warmup-s", type=float, default=2.0, help="unmeasured closed-loop time before the window")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--rows", type=int, default=None, help="model.max_batch_size (default: the profile's / 1)")
    ap.add_argument("--batching", choices=("auto", "on", "off"), default="auto",
                    help="model.continuous_batching (auto: unset, i.e. the profile's on CUDA, off on CPU even with --rows; "
                         "CPU batching is --rows N --batching on)")
    ap.add_argument("--threads", type=int, default=None, help="model.cpu_threads")
    ap.add_argument("--token-budget", type=int, default=None,
                    help="model.prefill_token_budget (default: the profile's, 1024)")
    ap.add_argument("--items", type=int, default=64, help="distinct evaluation items the clients cycle over")
    ap.add_argument("--seed", type=int, default=3000, help="evaluation set seed")
    ap.add_argument("--quality", type=int, default=90, help="JPEG quality of the inline images")
    ap.add_argument("--py-spy", default=None, metavar="DIR", help="record the daemon with py-spy into DIR")
    ap.add_argument("--label", default="", help="free text for the header (e.g. 'before' / 'after')")
    ap.add_argument("--py-spy-gil", action="store_true",
                    help="py-spy samples only the thread holding the GIL (shares = who holds it how long)")
    ap.add_argument("--daemon-log", default=None, help="copy the daemon's log (WARNING and up) to this file")
    ap.add_argument("--front-processes", default="auto", metavar="N[,N...]",
                    help="variants: mqtt.front_processes of each daemon run (0 = one process, auto = the "
                         "daemon's default), e.g. auto,0,2,4")
    ap.add_argument("--members", default="", metavar="M[,M...]",
                    help="variants after those: M one-process daemons in a pool, clients in pool mode, e.g. 2")
    args = ap.parse_args(argv)
    try:
        variants: list[tuple[int | str, int | None]] = [
            (f if f == "auto" else int(f), None) for f in args.front_processes.split(",") if f]
        variants += [(0, int(m)) for m in args.members.split(",") if m]
    except ValueError:
        print("--front-processes / --members: give comma-separated integers (or auto), e.g. auto,0,2,4",
              file=sys.stderr)
        return 2
    if not variants or min((f for f, _ in variants if f != "auto"), default=0) < 0 \
            or min((m for _, m in variants if m is not None), default=1) < 1:
        print("--front-processes: give counts >= 0; --members: counts >= 1", file=sys.stderr)
        return 2
    counts = [int(c) for c in args.clients.split(",") if c]
    if not counts or min(counts) < 1:
        print("--clients: give positive counts, e.g. 1,8,32", file=sys.stderr)
        return 2

    from edgevlm.daemon.demo_processes import start_private_broker

    items = _items(args.items, args.seed, args.quality)  # encoded before any clock starts
    broker = start_private_broker("edgevlm-throughput-")
    if broker is None:
        print("mosquitto not found: apt-get install mosquitto", file=sys.stderr)
        return 2
    spy = shutil.which("py-spy") or (str(Path(sys.executable).parent / "py-spy")
                                     if (Path(sys.executable).parent / "py-spy").exists() else None)
    results: list[dict[str, Any]] = []
    try:
        for fronts, members in variants:
            results += _run_variant(args, broker, items, counts, spy, fronts, members)
    finally:
        broker.stop()
    import torch

    cuda = torch.cuda.get_device_name(0) if args.device.startswith("cuda") and torch.cuda.is_available() else None
    print(f"model {args.model or 'demo'} on {args.device}{f' ({cuda})' if cuda else ''}  profile {args.profile}  "
          f"rows {args.rows}  batching {args.batching}  token budget {args.token_budget}  max_new_tokens {args.max_new_tokens}  window "
          f"{args.duration_s:.0f} s  {platform.machine()} {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}  {args.label}")
    print("| variant | clients | answers/s | p50 ms | p99 ms | daemon e2e p50 ms | mean batch | accuracy | errors |"
          " daemon / fronts CPU ms per answer |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for r in results:
        print(f"| {r['variant']} | {r['clients']} | {r['answers_per_s']:.1f} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | "
              f"{r['e2e_p50_ms']:.1f} | {r['mean_batch_size']:.2f} | {100 * r['accuracy']:.1f}% | "
              f"{r['errors'] or '-'} | {r['daemon_cpu_ms_per_answer']:.2f} / {r['fronts_cpu_ms_per_answer']:.2f} |")
    names = [name for name, _ in STAGES] + ["outside"]
    print("\nstages of the round trip, ms p50 / mean (see the module doc); CPUs busy in the window")
    print("| variant | clients | " + " | ".join(names) + " | host / daemon / fronts / broker / clients CPUs |")
    print("|---|---:|" + "---:|" * len(names) + "---|")
    for r in results:
        st, c = r["stages_ms"], r["cpu"]
        print(f"| {r['variant']} | {r['clients']} | " + " | ".join(
            f"{st[n]['p50']:.1f} / {st[n]['mean']:.1f}" if n in st else "-" for n in names)
            + f" | {c['host']} / {c['daemon']} / {c['fronts']} / {c['broker']} / {c['clients']} of {c['host_cpus']} |")
    goal_rows = [r for r in results if r["clients"] == GOAL_CLIENTS]
    if goal_rows:
        print(f"\ngoal at {GOAL_CLIENTS} clients (issue 13, set for the demo model on the H200): >= "
              f"{GOAL_ANSWERS_PER_S:.0f} answers/s, p99 <= {GOAL_P99_MS:.0f} ms, no errors")
        for r in goal_rows:
            r["goal_met"] = (r["answers_per_s"] >= GOAL_ANSWERS_PER_S and r["p99_ms"] <= GOAL_P99_MS
                             and not r["errors"])
            print(f"  {r['variant']}: {'met' if r['goal_met'] else 'NOT met'} ({r['answers_per_s']:.1f} answers/s, "
                  f"p99 {r['p99_ms']:.0f} ms, accuracy {100 * r['accuracy']:.1f}%)")
    print(json.dumps({"bench": "daemon_throughput", "model": args.model or "demo", "device": args.device,
                      "gpu": cuda, "profile": args.profile, "rows": args.rows, "batching": args.batching, "token_budget": args.token_budget,
                      "max_new_tokens": args.max_new_tokens, "duration_s": args.duration_s, "label": args.label,
                      "front_processes": args.front_processes, "members": args.members,
                      "results": results, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
