"""Installed as ``sitecustomize`` by ``scripts/gpu_session.sh check`` (and ``check_demo``): every
Python process there then refuses, with an ImportError naming it, a package that this project's
own code imports (files under the repository, outside .venv) and that the lent GPU machine's
image lacks and no carried wheel supplies. So a command that would fail there for a missing
package fails here first, at no device time.

The image's packages are those the device library lists for the 'cuda' image
(/work/.library/device/KINDS.md, "Python packages already there", read on 2026-11-17); the
carried ones are the distributions of the wheels `gpu_session.sh wheels` downloads, named in
``LWM_CARRIED`` (comma-separated). Imports made by installed libraries are not checked: the
image holds its own versions of them, with their own needs.
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata
import os
import re
import sys
import tomllib

IMAGE_LIST = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn
einops equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec
gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio
iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml
markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda
numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13
nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum
opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy
portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich
sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy
tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop
wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
"""


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


ROOT = os.path.realpath(os.environ.get("LWM_CHECK_ROOT", os.getcwd()))
with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    PROJECT = tomllib.load(f)["project"]["name"]  # travels as the working tree
ALLOWED = {normalize(n) for n in (*IMAGE_LIST.split(), PROJECT)} | {
    normalize(n) for n in os.environ.get("LWM_CARRIED", "").split(",") if n
}
VENV = os.path.join(ROOT, ".venv")
DISTRIBUTIONS = importlib.metadata.packages_distributions()


def _project_caller() -> str | None:
    """The file of the first frame outside the import machinery, if it is the project's."""
    frame = sys._getframe(2)
    while frame is not None and (
        frame.f_code.co_filename.startswith("<") or "importlib" in frame.f_code.co_filename
    ):
        frame = frame.f_back
    if frame is None:
        return None
    path = os.path.realpath(frame.f_code.co_filename)
    inside = path.startswith(ROOT + os.sep) and not path.startswith(VENV + os.sep)
    return path if inside else None


class NotOnTheImage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if path is not None:  # a submodule: its package was checked
            return None
        dists = DISTRIBUTIONS.get(name)
        if not dists or any(normalize(d) in ALLOWED for d in dists):
            return None  # the standard library, the project, or on the image or carried
        caller = _project_caller()
        if caller is None:
            return None
        raise ImportError(
            f"{name} (from {', '.join(dists)}), imported by {os.path.relpath(caller, ROOT)}, "
            "is not on the GPU machine's image and no carried wheel supplies it"
        )


sys.meta_path.insert(0, NotOnTheImage())
