"""The trainer tier runs on its whole stack (Ray, vLLM, torch), imported here for real:
a broken install, or an import error inside vLLM, fails the tier's collection in
`make test` instead of turning it into skips."""

import ray  # noqa: F401
import vllm  # noqa: F401
