"""File descriptor 2 into a temporary file for a block, shown again afterwards: TensorFlow's
allocator logs its text dump there, below Python's sys.stderr."""

from __future__ import annotations

import os
import sys
import tempfile


class StderrCapture:
    """File descriptor 2 into a temporary file for the block; shown again afterwards."""

    def __init__(self):
        self._file = None
        self._saved = None

    def start(self):
        sys.stderr.flush()
        self._file = tempfile.TemporaryFile(mode="w+b")
        self._saved = os.dup(2)
        os.dup2(self._file.fileno(), 2)

    def stop(self) -> str:
        """Fd 2 back where it was; what was captured, shown again and returned. Idempotent."""
        data = b""
        try:
            if self._saved is not None:
                try:
                    sys.stderr.flush()
                except Exception:
                    pass
                os.dup2(self._saved, 2)
                os.close(self._saved)
                self._saved = None
                self._file.seek(0)
                data = self._file.read()
        finally:
            if self._file is not None:
                self._file.close()
                self._file = None
        if data:
            os.write(2, data)  # the user still sees what TensorFlow logged
        return data.decode(errors="replace")
