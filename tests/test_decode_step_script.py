"""scripts/decode_step.py --tiny end to end (interpreter): every row ok, one results file, the table last."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tiny_decode_step_runs_and_checks(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "decode_step.py"), "--tiny", "--out", str(tmp_path),
                          "--flat", "--batches", "3"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    [results] = tmp_path.glob("decode-step-*.json")
    data = json.loads(results.read_text())
    assert [r["status"] for r in data["compile"]] == ["ok"]
    rows = data["decode step"]
    assert [(r["batch"], r["mode"]) for r in rows] == [(3, "eager"), (3, "compiled")]  # batch 3: one is a case of it
    assert all(r["status"] == "ok" and r["ms"] > 0 for r in rows)
    assert all(r["slots_equal"] and r["y_stage_err"] <= 1e-2 for r in rows if r["mode"] == "compiled")
    table = run.stdout.strip().splitlines()
    assert table[-4].startswith("| batch | context | mode | ms | vs_eager | status |") and table[-1].endswith("| ok |")
