"""lab.spy_shares charges py-spy samples to frames, or to the compiled graph's operations by line."""

from __future__ import annotations

import pytest

from lab.spy_shares import main

GRAPH = """\
def call(args):
    buf0 = torch.ops._C.onednn_mm.default(arg0, arg1, None)
    cpp_fused_add_mul_3(buf0, arg2)
    torch.ops.vllm.unified_attention_with_output.default(buf0, arg3)
"""


def raw_profile(tmp_path, graph_file: str) -> str:
    loop = "main (w.py:1);worker_busy_loop (w.py:9);execute_model (r.py:4)"
    graph = f"Runner.call ({graph_file}:{{line}});OpOverload.__call__ (torch/_ops.py:875);gemm (libx.so)"
    lines = [
        f"{loop};{graph.format(line=2)} 50",
        f"{loop};{graph.format(line=4)} 30",
        f"{loop};{graph.format(line=3)} 10",
        f"{loop};sample (s.py:7) 10",
        "Thread._bootstrap (threading.py:1);Event.wait (threading.py:2) 400",  # an idle thread: not counted
    ]
    path = tmp_path / "profile.raw"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_ops_of_the_compiled_graph_by_line(tmp_path, capsys):
    (tmp_path / "graphs" / "ab").mkdir(parents=True)
    (tmp_path / "graphs" / "ab" / "cab123.py").write_text(GRAPH)
    profile = raw_profile(tmp_path, "/elsewhere/cab123.py")
    assert main([profile, "--within", "worker_busy_loop", "--by", "op", "--inductor-dir", str(tmp_path / "graphs")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "100 samples within worker_busy_loop"
    assert out[1:] == [" 50.0 %  torch.ops._C.onednn_mm.default",
                       " 30.0 %  torch.ops.vllm.unified_attention_with_output.default",
                       " 10.0 %  cpp_fused_add_mul_3",
                       " 10.0 %  sample s.py:7"]


def test_frames_skip_torch_plumbing(tmp_path, capsys):
    profile = raw_profile(tmp_path, "cab123.py")
    assert main([profile, "--within", "worker_busy_loop", "--top", "1"]) == 0
    # the innermost frame is native (no file): it is the key as it is
    assert capsys.readouterr().out.splitlines()[1] == " 90.0 %  gemm (libx.so)"


def test_nothing_within_says_so(tmp_path):
    with pytest.raises(SystemExit, match="no samples within Engine.step"):
        main([raw_profile(tmp_path, "cab123.py"), "--within", "Engine.step"])
