"""The peer-benchmark harness records a peer that cannot start or run as failed, with its error."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from bench_peers import markdown, run_system, summarize  # noqa: E402


def test_a_peer_that_cannot_start_is_recorded_with_its_error():
    out = run_system("ghost", ["/nonexistent/python", "runner.py"], timeout=10)
    s = summarize(out, None, 3)
    assert s["status"] == "failed" and "could not start" in s["error"] and "setup_peers.sh" in s["error"]


def test_a_peer_that_crashes_is_recorded_with_its_stderr():
    out = run_system("crash", [sys.executable, "-c", "import sys; sys.stderr.write('boom: no model'); sys.exit(3)"],
                     timeout=30)
    s = summarize(out, None, 3)
    assert s["status"] == "failed" and "exit 3" in s["error"] and "boom: no model" in s["error"]


def test_failed_rows_stay_in_the_table():
    report = {"systems": {"ok": {"status": "ok", "tokens_per_s": {"median": 10.0, "min": 9.0, "max": 11.0},
                                 "ttft_ms_median": 5.0, "peak_rss_mib": 100.0, "identical_prompts": "3/3"},
                          "bad": {"status": "failed", "error": "ImportError: onnxruntime_genai"}},
              "ratios": {}, "roofline": {"read_bandwidth_gbs": 1.0, "copy_bandwidth_gbs": 1.0, "bytes_per_token": 1e6,
                                         "roofline_tokens_per_s": 1000.0, "plain_share_of_roofline": {}},
              "command": "x"}
    md = markdown(report)
    assert "| bad | failed: ImportError: onnxruntime_genai" in md and "| ok | 10.0 (9.0–11.0)" in md


def test_results_name_the_cpu_vendor_and_the_flags_that_pick_the_kernels():
    """bench/lib/host.machine(): the vendor (the native step's per-CPU defaults follow it) and which of the
    kernel-picking flags the CPU lists, so results from different machines can be told apart."""
    import platform
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "lib"))
    import host
    m = host.machine()
    text = Path("/proc/cpuinfo").read_text()
    line = next(ln for ln in text.splitlines() if ln.split(":")[0].strip() in ("flags", "Features"))
    listed = set(line.split(":", 1)[1].split())
    assert m["kernel_flags"] == [f for f in host.KERNEL_FLAGS if f in listed]
    if platform.machine() in ("x86_64", "AMD64"):
        assert f"vendor_id\t: {m['vendor']}" in text
