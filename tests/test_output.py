"""gloo's connection chatter: the line filter, and the stdout relay of a process outside the launcher."""

from __future__ import annotations

import os
import pty
import subprocess
import textwrap
import time

import pytest
from jobs.procs import ROOT, clean_env, free_port, python, run_all

from mirrorax.cluster.output import ChatterFilter

GLOO = "[Gloo] Rank {} is connected to 3 peer ranks. Expected number of connected peer ranks is : 3"
# Two devices' threads printing at once (seen under mirrorax launch): one line holds both messages,
# the second newline comes alone.
MANGLED = ["[Gloo] Rank 2 is connected to [Gloo] Rank 33 is connected to  peer ranks. 3Expected number of "
           "connected peer ranks is :  peer ranks. 3Expected number of connected peer ranks is : 3", ""]


pytestmark = pytest.mark.slow  # starts processes


def test_the_filter_drops_gloo_lines_whole_or_mangled_and_keeps_the_rest():
    clean = ChatterFilter().clean
    lines = ["Epoch 1/3", GLOO.format(0), *MANGLED, "", "[Gloo] other news", "1", "loss 0.5"]
    assert [clean(line) for line in lines] == ["Epoch 1/3", None, None, None, "", "[Gloo] other news", "1",
                                               "loss 0.5"]


# A print of the process's own landing between gloo's pieces (each piece is a write of its own), as seen
# in a 2-process job under the launcher: the printed line is shown whole, nothing of gloo's is.
CUT = [("[Gloo] Rank 2 is connected to 3 peer ranks. saved to /tmp/ckpt", "saved to /tmp/ckpt"),
       ("Expected number of connected peer ranks is : 3", None),
       ("[Gloo] Rank 0 is connected to mirrorax: process 1 names /tmp/a", "mirrorax: process 1 names /tmp/a"),
       ("3 peer ranks. Expected number of connected peer ranks is : 3", None),
       # gloo's newline cut a print in two: the two halves come out as the one line they were
       ("sum [Gloo] Rank 0 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3", None),
       (GLOO.format(1), None),
       ("4.0", "sum 4.0"),
       ("", ""),  # the user's own empty line: nothing of gloo's is owed
       ("[Gloo] Rank 3 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3", None),
       # a print between gloo's last number and its newline (which comes alone, as an empty line)
       ("[Gloo] Rank 1 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3saved", "saved"),
       ("", None),
       ("done", "done")]


def test_the_filter_takes_gloos_pieces_out_of_a_printed_line_and_joins_what_they_cut():
    chatter = ChatterFilter()
    assert [chatter.clean(line) for line, _ in CUT] == [shown for _, shown in CUT]
    assert chatter.owed == 0 and chatter.flush() is None
    chatter.clean("loss [Gloo] Rank 0 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3")
    assert chatter.flush() == "loss "  # a stream that ends there still shows it


def _relay(code: str, **popen) -> subprocess.Popen:
    snippet = ("import os, sys, time\nfrom mirrorax.cluster import failure as _failure, output as _output\n"
               "assert _output.install()\n" + textwrap.dedent(code))
    return subprocess.Popen(python("-c", snippet), env=clean_env(), cwd=ROOT, **popen)


@pytest.mark.timeout(60)
def test_the_relay_drops_chatter_written_to_fd_1_and_keeps_everything_else():
    proc = _relay(f"""
        print("before", flush=True)
        os.write(1, {(GLOO.format(1) + chr(10)).encode()!r})  # as C++ writes it, past Python
        os.write(1, {(MANGLED[0] + chr(10) + chr(10)).encode()!r})
        os.write(1, {(CUT[4][0] + chr(10)).encode()!r}); os.write(1, b"4.0\\n")
        sys.stdout.write("progress 1/2\\r"); sys.stdout.flush(); time.sleep(0.3)
        print("after")""", stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = proc.communicate(timeout=50)
    assert proc.returncode == 0 and out == b"before\nsum 4.0\nprogress 1/2\rafter\n", repr(out)


@pytest.mark.timeout(60)
def test_the_relay_loses_nothing_when_a_process_leaves_through_die():
    proc = _relay("""
        for i in range(2000):
            print("line", i)
        _failure.die("bye", 3)""", stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=50)
    assert proc.returncode == 3 and out.splitlines()[-1] == "line 1999" and "bye" in err, (out[-200:], err)


@pytest.mark.timeout(60)
def test_the_last_words_of_a_process_killed_at_once_still_come_out():
    proc = _relay("""
        import signal
        print("last words", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)""", stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = proc.communicate(timeout=50)
    assert proc.returncode == -9 and out == b"last words\n", out


@pytest.mark.timeout(60)
def test_on_a_terminal_the_relay_keeps_stdout_a_terminal():
    master, slave = pty.openpty()
    proc = _relay(f"""
        import shutil
        print("tty", os.isatty(1), sys.stdout.isatty(), shutil.get_terminal_size().columns > 0)
        os.write(1, {(GLOO.format(0) + chr(10)).encode()!r})
        print("done")""", stdout=slave, stderr=slave)
    os.close(slave)
    out, deadline = b"", time.monotonic() + 50
    while time.monotonic() < deadline:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(master)
    assert proc.wait(timeout=10) == 0
    text = out.decode().replace("\r\n", "\n")
    assert text == "tty True True True\ndone\n", repr(text)


def _direct(n: int, **env: str):
    port = free_port()
    envs = [clean_env(MIRRORAX_COORDINATOR=f"127.0.0.1:{port}", MIRRORAX_NUM_PROCESSES=str(n),
                      MIRRORAX_PROCESS_ID=str(i), MIRRORAX_CPU_DEVICES="2", **env) for i in range(n)]
    return run_all([python("tests/jobs/psum.py")] * n, envs, timeout=80)


@pytest.mark.multi_process
@pytest.mark.timeout(90)
@pytest.mark.parametrize("verbose", ["", "1"])
def test_a_real_job_without_the_launcher_prints_no_gloo_lines_unless_asked(verbose):
    codes, outs, _ = _direct(2, MIRRORAX_VERBOSE_COLLECTIVES=verbose)
    assert codes == [0, 0], outs
    for i, out in enumerate(outs):
        assert f"RESULT {i} 2 4 6.0 joined=True" in out, out
        assert ("[Gloo] Rank" in out) == bool(verbose), out
