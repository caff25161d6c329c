"""One progress line on standard error, redrawn in place, only where standard error is a terminal
(and not TERM=dumb): redirected to a file or a pipe it writes nothing. The Python twin of
moeline's base/progress.h, for scripts/make-model and scripts/gguf_convert.py."""

import os
import sys
import time


class TerminalProgress:
    def __init__(self, what, unit):
        self.what, self.unit = what, unit
        self.enabled = sys.stderr.isatty() and os.environ.get("TERM") != "dumb"
        self.drawn = False
        self.last = 0.0

    def update(self, done, total=None, detail=""):
        """`done` of `total` units (total None: a count without a percentage)."""
        if not self.enabled:
            return
        now = time.monotonic()
        if self.drawn and (total is None or done < total) and now - self.last < 0.1:
            return
        self.last, self.drawn = now, True
        if total:
            text = f"{self.what} {100 * done // total:3d}% ({done:,}/{total:,} {self.unit})"
        else:
            text = f"{self.what} {done:,} {self.unit}"
        sys.stderr.write(f"\r\033[K{text}{', ' + detail if detail else ''}")
        sys.stderr.flush()

    def finish(self):
        if self.drawn:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
            self.drawn = False

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.finish()
