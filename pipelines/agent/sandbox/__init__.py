"""The sandbox that runs model-written Python: persistent, fast, and isolated.

Model-written code is hostile input. Each trajectory gets a :class:`Sandbox`: a persistent Python
runtime (numpy as ``np``, PIL's ``Image``, matplotlib's ``plt`` with the Agg backend, ``decord`` for
video) holding the task's media as ``image_clue_0``, ``image_clue_1``, ... or ``video_clue_0``.
``plt.show()``, ``img.show()`` and ``display(obj)`` return images (at most
``max_images_per_call``, larger than :data:`SHOWN_IMAGE_MAX_PIXELS` downscaled, each with one
note in the output; a figure that is one image in a bare Axes, as ``plt.imshow(crop);
plt.axis("off"); plt.show()`` draws, is composed with PIL instead of matplotlib's renderer: the
same picture, several times cheaper); printed output is kept up to ``max_output_chars`` (head
and tail, with a marker); every call ends in an :class:`ExecResult` with status ``ok | error | timeout | oom |
crashed``. A call that times out, crashes or is killed still returns what the code printed before
(the output lives in memory the host shares), then the reason ("killed after 3 s", "killed by
SIGSEGV").

How it is fast: one *zygote* process per host process imports numpy, PIL, matplotlib and decord
once; each sandbox is a fork of it, so starting one costs milliseconds instead of the second a
cold ``import matplotlib`` takes.

- ``client.py``: :class:`Sandbox` and :class:`ExecResult`, the host talking to one worker.
- ``isolation.py``: the isolation mode and the bubblewrap command line; what is and is not
  isolated.
- ``zygote_host.py``: starts the zygote and asks it for workers; ``_zygote.py`` is the zygote
  itself, the code that runs inside the sandbox.
- ``media.py``: task images and videos going in, shown images coming back.
"""

from pipelines.agent.sandbox.client import ExecResult, Sandbox, SandboxSetupError, Status
from pipelines.agent.sandbox.isolation import PRELOADED_MODULES, bwrap_available, isolation_mode
from pipelines.agent.sandbox.media import MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS, SHOWN_IMAGE_MAX_PIXELS
from pipelines.agent.sandbox.zygote_host import shutdown

__all__ = ["MAX_IMAGE_BYTES", "MAX_IMAGE_PIXELS", "PRELOADED_MODULES", "SHOWN_IMAGE_MAX_PIXELS",
           "ExecResult", "Sandbox", "SandboxSetupError", "Status", "bwrap_available",
           "isolation_mode", "shutdown"]
