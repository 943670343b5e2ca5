"""Child processes that end with the process that started them."""

from __future__ import annotations

import os
import threading
import time

# How often a child process checks that the process that started it is still there.
PARENT_CHECK_S = 0.5


def exit_with_parent(parent_pid: int, interval_s: float = PARENT_CHECK_S) -> threading.Thread:
    """Ends this process once `parent_pid` is gone (an orphan is re-parented and sees another ppid), whatever it is
    doing: a child must not outlive its parent, and one loading weights or allocating pools reads no pipe."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        os._exit(1)

    watcher = threading.Thread(target=watch, name="hybridkv-parent-watch", daemon=True)
    watcher.start()
    return watcher
