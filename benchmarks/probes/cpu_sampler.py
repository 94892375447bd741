"""Beside a benchmark run (`run_cpu_every_part.sh`): every second, each process's cumulative CPU time
(utime+stime) and current cmdline, and the environment service's first_start_unix (its /health, the run's clock
zero). Writes OUT when OUT.stop exists."""
import json, os, re, sys, time, urllib.request
out = sys.argv[1]
tick = os.sysconf("SC_CLK_TCK")
names, series, first_start = {}, [], None
while not os.path.exists(out + ".stop"):
    now = time.time()
    row = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                st = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
        except OSError:
            continue
        rest = st[st.rindex(")") + 2:].split()
        row[pid] = (int(rest[11]) + int(rest[12])) / tick
        names[pid] = cmd or st[st.index("(") + 1:st.rindex(")")]
        if first_start is None and "verl_tide.cli env serve --port" in cmd:
            port = re.search(r"--port (\d+)", cmd).group(1)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    first_start = json.load(r).get("first_start_unix")
            except Exception:
                pass
    series.append((now, row))
    time.sleep(max(0.0, 1.0 - (time.time() - now)))
json.dump({"names": names, "series": series, "first_start": first_start}, open(out, "w"))
