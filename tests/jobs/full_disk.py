"""A full disk under ``mx.CheckpointManager``: run by ``tests/test_object_checkpoints.py`` in a mount namespace of
its own (``unshare -rm``) on a small tmpfs, so that the disk is really full (ENOSPC), then freed.

``full_disk.py save DIR``: a manager in ``DIR`` saves checkpoints 1 and 2, the job fills the file system
(``DIR/../filler``), then saves 3 as its last act: that save fails at exit. ``full_disk.py check DIR``: the
filler removed, what TF's ``tf.train.latest_checkpoint(DIR)`` names, what a fresh model restores from it
(``RESTORED <counter>``), and every file left under ``DIR`` (``FILES ...``).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")


def objects():
    import keras

    import mirrorax as mx

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64)])
    counter = keras.Variable(0, dtype="int32", name="counter")
    return mx.Checkpoint(model=model, counter=counter), counter


if __name__ == "__main__":
    import mirrorax as mx

    what, directory = sys.argv[1], sys.argv[2]
    filler = os.path.join(directory, "..", "filler")
    if what == "save":
        checkpoint, counter = objects()
        manager = mx.CheckpointManager(checkpoint, directory, max_to_keep=3)
        for n in (1, 2):
            counter.assign(n)
            manager.save()
        checkpoint.wait()
        with open(filler, "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError as e:
                print(f"FILLED {e.strerror}", flush=True)
        counter.assign(3)
        manager.save()  # the program's last act: written (and failing) at exit
    else:
        import tensorflow as tf

        os.remove(filler)
        latest = tf.train.latest_checkpoint(directory)
        print(f"LATEST {latest}", flush=True)
        checkpoint, counter = objects()
        checkpoint.restore(latest)
        print(f"RESTORED {int(counter.numpy())}", flush=True)
        found = sorted(os.path.relpath(os.path.join(d, n), directory) for d, dirs, files in os.walk(directory)
                       for n in dirs + files)
        print("FILES " + " ".join(found), flush=True)
