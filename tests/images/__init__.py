"""The project's images without a Docker engine: `build` makes them with Debian's buildah
from a Debian base made here (no container registry needed), skipping a build whose
inputs have not changed; `load` puts one into a containerd (a test node's) by its socket.
`make images` (tests/images/images.mk) runs `python3 -m tests.images.build`.

Only the standard library: these run before the virtualenv exists."""
