# The project's images, built with Debian's buildah (no Docker engine) from a Debian base
# made here by mmdebstrap (no container registry): tests/images/build.py.
#
# Include this fragment from the top-level Makefile, or use it alone:
# `make -f tests/images/images.mk images`.
#
#   make images                 the operator, the CPU trainer and the environment image (what
#                               the tests run): localhost/rlhf-operator:VERSION,
#                               localhost/rlhf-trainer:VERSION-cpu, localhost/rlhf-environment:VERSION
#   make image-trainer-gpu      the GPU trainer image, localhost/rlhf-trainer:VERSION (vLLM's
#                               CUDA build, some 10 GB more), only where asked, then its
#                               check without a GPU (tests/images/check_gpu_image.py)
#   make images IMAGES="operator trainer-cpu trainer-gpu"
#
# An image whose inputs (Dockerfile, the files it copies, build arguments, base) match the
# one in buildah's storage is not rebuilt: a second `make images` takes about a second.
# Into a containerd (a node's): python3 -m tests.images.load --address SOCKET REF...

# Not PYTHON: the top Makefile's PYTHON is the interpreter that creates the venv. The build
# needs only the standard library (3.11, for tomllib).
IMAGES_PYTHON ?= python3
IMAGES ?= operator trainer-cpu environment
# Installs wait for another's dpkg lock (CI installs packages in parallel make jobs).
APT_GET ?= apt-get -o DPkg::Lock::Timeout=600
IMAGES_SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: images image-trainer-gpu image-tools

images: image-tools  ## build the operator, CPU trainer and environment images with buildah (IMAGES=... to choose)
	$(IMAGES_PYTHON) -m tests.images.build $(IMAGES)

image-trainer-gpu: image-tools  ## build the GPU trainer image with buildah (vLLM's CUDA stack) and check it
	$(IMAGES_PYTHON) -m tests.images.build trainer-gpu
	$(IMAGES_PYTHON) -m tests.images.check_gpu_image

# Debian's packages, installed if missing; `apt-get update` only if the lists lack them.
image-tools:
	@command -v buildah >/dev/null && command -v mmdebstrap >/dev/null || { \
	  command -v apt-get >/dev/null || { echo "no apt-get here: install buildah and mmdebstrap yourself" >&2; exit 1; }; \
	  $(IMAGES_SUDO) $(APT_GET) install -y -q buildah mmdebstrap || \
	    { $(IMAGES_SUDO) $(APT_GET) update -q && $(IMAGES_SUDO) $(APT_GET) install -y -q buildah mmdebstrap; }; }
