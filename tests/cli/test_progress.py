#!/usr/bin/python3
"""Long commands show how far they are on a terminal, and only there; `moeline load --plot` draws
latency percentiles over the run.

- On a pseudo-terminal, `moeline quantize`, `moeline run` (loading the model), `moeline load` and
  `scripts/make-model` redraw one progress line on standard error ("... 100% (n/n tensors)"), and
  erase it when done; with standard error a pipe (CI, logs) or TERM=dumb they write no such line.
- `moeline load --target decode --plot FILE.png` writes an 8-bit RGB PNG (read back with zlib here,
  not with moeline's writer) whose two panels each hold the p50, p90 and p99 lines' colours, and
  names it in its JSON.

    test_progress.py --moeline BIN --model DIR --make-model scripts/make-model --workdir DIR
"""
import argparse
import json
import os
import pty
import shutil
import struct
import subprocess
import sys
import threading
import zlib

failures = []
ERASE = b"\r\x1b[K"
P50, P90, P99 = (31, 119, 180), (255, 127, 14), (214, 39, 40)


def check(name, condition, detail=""):
    print(("ok    " if condition else "FAIL  ") + name + (f": {detail}" if detail and not condition else ""))
    if not condition:
        failures.append(name)


def on_terminal(command, env=None, timeout=300):
    """Runs `command` with standard error on a pseudo-terminal; returns (exit code, stdout text,
    the bytes the terminal received)."""
    master, slave = pty.openpty()
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=slave, env=env)
    os.close(slave)
    received = bytearray()

    def drain():
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every writer has closed the terminal
                return
            if not chunk:
                return
            received.extend(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    out, _ = process.communicate(timeout=timeout)
    reader.join(timeout=10)
    os.close(master)
    return process.returncode, out.decode(errors="replace"), bytes(received)


def on_pipe(command, env=None, timeout=300):
    result = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True,
                            timeout=timeout, env=env)
    return result.returncode, result.stdout.decode(errors="replace"), result.stderr


def check_progress(name, command, what, unit):
    rc, _, terminal = on_terminal(command)
    text = terminal.decode(errors="replace")
    check(f"{name}: exits 0 on a terminal", rc == 0, text[-800:])
    check(f"{name}: progress line '{what}' reaches 100% ({unit})",
          what in text and "100%" in text and unit in text, repr(text[-400:]))
    last = terminal.rfind(what.encode())
    check(f"{name}: the line is erased at the end", ERASE in terminal[last:], repr(terminal[-200:]))


def check_quiet(name, command):
    rc, _, stderr = on_pipe(command)
    check(f"{name}: exits 0 with stderr a pipe", rc == 0, stderr[-800:])
    check(f"{name}: no progress line in a pipe", b"\x1b[K" not in stderr and b"%" not in stderr,
          repr(stderr[-300:]))
    env = dict(os.environ, TERM="dumb")
    rc, _, terminal = on_terminal(command, env=env)
    check(f"{name}: no progress line with TERM=dumb", rc == 0 and b"\x1b[K" not in terminal,
          repr(terminal[-300:]))


def read_png(path):
    """(width, height, rows of RGB bytes) of an 8-bit RGB, non-interlaced PNG."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    at, idat, width = 8, b"", 0
    while at < len(data):
        length, kind = struct.unpack(">I4s", data[at:at + 8])
        body = data[at + 8:at + 8 + length]
        assert zlib.crc32(kind + body) == struct.unpack(">I", data[at + 8 + length:at + 12 + length])[0]
        if kind == b"IHDR":
            width, height, depth, colour = struct.unpack(">IIBB", body[:10])
            assert (depth, colour) == (8, 2), "not 8-bit RGB"
        elif kind == b"IDAT":
            idat += body
        at += 12 + length
    raw = zlib.decompress(idat)
    stride = 1 + 3 * width
    rows = []
    for y in range(height):
        line = raw[y * stride:(y + 1) * stride]
        assert line[0] == 0, "unexpected filter"  # moeline writes filter 0 only
        rows.append(line[1:])
    return width, height, rows


def colour_count(rows, colour, first_row, last_row):
    pixel = bytes(colour)
    return sum(row.count(pixel) for row in rows[first_row:last_row])


def check_plot(moeline, model, workdir):
    plot = os.path.join(workdir, "latency.png")
    if os.path.exists(plot):
        os.remove(plot)
    command = [moeline, "load", "--target", "decode", "--model", model, "--threads", "1",
               "--concurrency", "2", "--duration-s", "3", "--prompt-tokens", "16",
               "--max-tokens", "16", "--plot", plot, "--json"]
    rc, out, terminal = on_terminal(command)
    text = terminal.decode(errors="replace")
    check("load --plot: exits 0", rc == 0, text[-800:])
    check("load: progress line on a terminal", "load 100% (3/3 s)" in text and "errors" in text,
          repr(text[-300:]))
    report = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
    check("load --plot: the JSON names the picture", report.get("plot") == plot, out[-300:])
    check("load --plot: the file exists", os.path.exists(plot))
    if not os.path.exists(plot):
        return
    width, height, rows = read_png(plot)
    check("load --plot: a picture of a sensible size", width >= 600 and height >= 400,
          f"{width}x{height}")
    half = height // 2
    for panel, (first, last) in (("ttft", (0, half)), ("per-token", (half, height))):
        for name, colour in (("p50", P50), ("p90", P90), ("p99", P99)):
            # The legend square alone is 60 pixels; a drawn line adds many more.
            count = colour_count(rows, colour, first, last)
            check(f"load --plot: {panel} panel has its {name} line", count > 200, f"{count} pixels")
    broken = os.path.join(workdir, "no-such-dir", "x.png")
    rc, _, stderr = on_pipe(command[:-3] + ["--plot", broken, "--json"])
    check("load --plot to an unwritable path fails with a message",
          rc != 0 and b"--plot" in stderr, stderr[-300:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--moeline", required=True)
    ap.add_argument("--model", required=True, help="a small F32 checkpoint folder")
    ap.add_argument("--make-model", required=True)
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    m = args.moeline
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    gguf = os.path.join(args.workdir, "model.q8_0.gguf")
    quantize = [m, "quantize", "--model", args.model, "--type", "q8_0", "--out", gguf]
    check_progress("quantize", quantize, "quantizing to q8_0", "tensors")
    check_quiet("quantize", quantize)
    run = [m, "run", "--model", args.model, "--tokens", "1,2,3", "--max-tokens", "2"]
    check_progress("run", run, "loading model", "layers")
    check_quiet("run", run)
    check_progress("run on the GGUF", [*run[:3], gguf, *run[4:]], "loading model", "layers")
    make_model = [sys.executable, args.make_model, "--arch", "qwen3_moe", "--preset", "tiny",
                  "--seed", "7", "--out", os.path.join(args.workdir, "made")]
    check_progress("make-model", make_model, "make-model: writing", "bytes")
    check_quiet("make-model", make_model)
    check_plot(m, args.model, args.workdir)
    print(f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
