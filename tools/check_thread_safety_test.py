"""tools/check_thread_safety.py: its command rewriting, and (where clang is installed) that a lock
annotation broken in a source file fails the check while a kept one passes."""
import json
import os
import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import check_thread_safety  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(__file__), "check_thread_safety.py")
FLAGS = "-std=c++17 -Wthread-safety -Werror=thread-safety"
SOURCE = """
struct __attribute__((capability("mutex"))) Mutex {
  void Lock() __attribute__((acquire_capability()));
  void Unlock() __attribute__((release_capability()));
};
Mutex mu;
int guarded __attribute__((guarded_by(mu)));
void Touch() {
  %s
}
"""


def test_the_output_is_dropped_and_only_syntax_is_checked():
    args = check_thread_safety.syntax_only("/usr/bin/clang++ -DX -I/a -o obj/x.o -c /src/x.cc")
    assert args == ["/usr/bin/clang++", "-fsyntax-only", "-DX", "-I/a", "/src/x.cc"]


def write_build(tmp_path, body, flags=FLAGS):
    source = tmp_path / "touch.cc"
    source.write_text(SOURCE % body)
    build = tmp_path / "build"
    build.mkdir()
    commands = [{"directory": str(build), "file": str(source),
                 "command": f"clang++ {flags} -o touch.o -c {source}"}]
    (build / "compile_commands.json").write_text(json.dumps(commands))
    return str(build / "compile_commands.json")


def run(commands):
    return subprocess.run([sys.executable, SCRIPT, commands], capture_output=True, text=True)


@pytest.mark.skipif(shutil.which("clang++") is None, reason="clang is installed by `make deps-fuzz`")
def test_an_access_without_its_lock_fails_and_one_under_it_passes(tmp_path):
    (tmp_path / "bad").mkdir()
    bad = run(write_build(tmp_path / "bad", "guarded = 1;"))
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "FAILED" in bad.stdout and "requires holding mutex 'mu'" in bad.stdout, bad.stdout
    (tmp_path / "good").mkdir()
    good = run(write_build(tmp_path / "good", "mu.Lock(); guarded = 1; mu.Unlock();"))
    assert good.returncode == 0, good.stdout + good.stderr
    assert "1 of 1 files pass" in good.stdout


def test_a_build_without_the_check_is_refused(tmp_path):
    r = run(write_build(tmp_path, "guarded = 1;", flags="-std=c++17"))
    assert r.returncode == 1
    assert "PATHWAYS_THREAD_SAFETY=ON" in r.stderr
