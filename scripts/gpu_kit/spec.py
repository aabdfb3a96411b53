"""What the GPU kit carries, builds and expects: one place for every version and limit.

Read by scripts/gpu_kit_prepare.py (here, with network) and scripts/gpu_kit/run.py (on
the GPU machine, no network). Standard library only.
"""

from __future__ import annotations

import re
from typing import Any

#: Bump when the bundle's layout or contents change: run.py refuses an older bundle.
KIT_VERSION = 2

#: Where prepare puts the bundle (repo-relative, ignored by .gitignore) and the name the
#: device tool's ``carry`` must list.
BUNDLE_DIR = ".gpu_kit"
BUNDLE_MANIFEST = "bundle.json"
#: Everything that travels: the working tree plus carried paths (device README, Limits).
TRAVEL_LIMIT = 64 * 1024 * 1024
#: One command on the device runs at most 600 s; the kit plans inside this.
DEFAULT_BUDGET_S = 560
#: Files that may come back from $OUT (at most 8): the kit writes these two.
RESULT_JSON = "gpu_kit.json"
RESULT_LOG = "gpu_kit.log"
#: The llama.cpp libraries built here by scripts/gpu_kit/prebuild_llama.py, when carried:
#: BUNDLE_DIR/PREBUILT_DIR/llama-cuda-sm90-<version>.tar.xz (+ its .json).
PREBUILT_DIR = "prebuilt"
PREBUILT_GLOB = "llama-cuda-*.tar.xz"

# -- llama.cpp (llama-cpp-python's sdist, trimmed) ------------------------------------------

LLAMA_CPP_VERSION = "0.3.36"
LLAMA_SDIST = f"llama_cpp_python-{LLAMA_CPP_VERSION}.tar.gz"
LLAMA_SRC_ARCHIVE = f"llama_cpp_python-{LLAMA_CPP_VERSION}-cuda-src.tar.gz"
#: Bump when the trim rules below change (the cached trimmed archive is keyed on it).
TRIM_VERSION = 1

#: Paths (relative to the sdist's top folder) a CUDA build of the Python package needs.
KEEP_TOP = ("CMakeLists.txt", "pyproject.toml", "LICENSE.md", "llama_cpp/")
LLAMA = "vendor/llama.cpp/"
KEEP_LLAMA = (
    "CMakeLists.txt", "LICENSE", "cmake/", "include/", "src/", "ggml/", "vendor/",
    # the GGUF converter and its library, for the test model
    "convert_hf_to_gguf.py", "conversion/", "gguf-py/gguf/", "gguf-py/pyproject.toml",
)
#: ggml backends the build leaves off (ggml_add_backend adds a folder only when its
#: GGML_<NAME> option is on): only ggml-cpu and ggml-cuda are compiled.
OTHER_BACKENDS = (
    "blas", "cann", "et", "hexagon", "hip", "metal", "musa", "opencl", "openvino", "rpc",
    "sycl", "virtgpu", "vulkan", "webgpu", "zdnn", "zendnn",
)
#: Inside kept folders, what an x86-64 CUDA build without common/ and mtmd never reads.
DROP_LLAMA = (
    *(f"ggml/src/ggml-{b}/" for b in OTHER_BACKENDS),
    # CPU kernels for other processors (ggml-cpu/CMakeLists.txt picks arch/x86 here)
    "ggml/src/ggml-cpu/arch/arm/", "ggml/src/ggml-cpu/arch/loongarch/",
    "ggml/src/ggml-cpu/arch/powerpc/", "ggml/src/ggml-cpu/arch/riscv/",
    "ggml/src/ggml-cpu/arch/s390/", "ggml/src/ggml-cpu/arch/wasm/",
    "ggml/src/ggml-cpu/kleidiai/", "ggml/src/ggml-cpu/spacemit/",
    # used by common/ (off, below) and by tools/mtmd (LLAVA_BUILD=OFF); the header-only
    # interface targets stay declared, their big headers go
    "vendor/cpp-httplib/", "vendor/miniaudio/miniaudio.h", "vendor/stb/stb_image.h",
)
#: llama-cpp-python forces llama.cpp's common library on, which its package never ships;
#: the trimmed source turns it off (and drops common/ with it).
CMAKE_PATCH = (
    'set(LLAMA_BUILD_COMMON ON CACHE BOOL "Build llama.cpp common library" FORCE)',
    'set(LLAMA_BUILD_COMMON OFF CACHE BOOL "Build llama.cpp common library" FORCE)',
)


def keep_sdist_member(rel: str) -> bool:
    """Whether a path of the llama-cpp-python sdist (without its top folder) is kept."""
    if rel.startswith(LLAMA):
        sub = rel[len(LLAMA):]
        if not sub.startswith(KEEP_LLAMA) or sub.startswith(DROP_LLAMA):
            return False
        return "/tests/" not in f"/{sub}"
    return rel.startswith(KEEP_TOP)


# -- wheels ------------------------------------------------------------------------------

#: Carried as wheels for Python 3.12, manylinux x86-64: the engines and every dependency
#: the GPU machine lacks (device KINDS.md package list, 2026-11-17). typing-extensions is
#: there, but pydantic 2.14 needs >= 4.16 and the machine's version is not recorded.
WHEELS = (
    "exllamav2==0.3.2",
    "exllamav3==1.6.5",
    "fastparquet==2026.9.0",  # exllamav2.conversion imports it at the top
    "cramjam==2.14.0",  # fastparquet
    "pydantic==2.14.4",  # exllamav3.util.memory imports it at the top
    "pydantic-core==2.50.5",
    "annotated-types==0.8.0",
    "typing-inspection==0.4.5",
    "typing-extensions==4.16.0",
    "marisa-trie==1.4.1",  # exllamav3's safetensors loader
    "diskcache==5.6.3",  # llama_cpp.llama_cache imports it at the top
    # on the GPU machine's image too (its version unrecorded); carried so that the CPU
    # rehearsal, whose venv need not have it, runs the same per-test --timeout
    "pytest-timeout==2.4.0",
)
#: The carried wheel the rehearsal installs beside its own venv for the test runs.
PYTEST_TIMEOUT = "pytest-timeout"
PY_VERSION = "3.12"
PLATFORMS = (
    "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64",
)
#: Requirements of carried packages that are deliberately not carried.
NOT_CARRIED = {
    "websockets": "exllamav2.server only (not imported by the engine or its converter)",
    "llguidance": "exllamav3 imports it inside try/except (grammar filters only)",
    "triton-windows": "Windows only",
    # localrun's Hub client (localrun/hub/, imported only for Hub names): the kit loads
    # local files, and the GPU machine has no network (its huggingface-hub is 1.x)
    "httpx2": "localrun.hub only (the kit loads local files; no network there)",
}
#: The environment markers of the GPU machine's python3.
DEVICE_MARKERS = {
    "python_version": PY_VERSION, "python_full_version": "3.12.3", "os_name": "posix",
    "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
    "implementation_name": "cpython", "platform_python_implementation": "CPython",
    "platform_release": "", "platform_version": "", "extra": "",
}
#: Python packages on the GPU machine's image (device KINDS.md, read 2026-11-17).
DEVICE_PACKAGES = frozenset((
    'absl-py', 'accelerate', 'aiofiles', 'aiohappyeyeballs', 'aiohttp', 'aiosignal',
    'annotated-doc', 'anyio', 'attrs', 'botorch', 'build', 'certifi', 'charset-normalizer',
    'chex', 'click', 'cloudpickle', 'cmake', 'colorama', 'contourpy', 'coverage', 'cuda-bindings',
    'cuda-core', 'cuda-pathfinder', 'cuda-toolkit', 'cupy-cuda13x', 'cycler', 'cython', 'diffrax',
    'e3nn', 'einops', 'equinox', 'etils', 'execnet', 'filelock', 'flatbuffers', 'flax',
    'fonttools', 'formulaic', 'frozenlist', 'fsspec', 'gpytorch', 'grpcio', 'h11', 'h5py',
    'hf-xet', 'httpcore', 'httpx', 'huggingface-hub', 'humanize', 'hypothesis', 'idna', 'imageio',
    'iniconfig', 'interface-meta', 'jax', 'jax-cuda13-pjrt', 'jax-cuda13-plugin', 'jaxlib',
    'jaxtyping', 'jinja2', 'joblib', 'kiwisolver', 'lazy-loader', 'lightning',
    'lightning-utilities', 'linear-operator', 'lineax', 'llvmlite', 'lxml', 'markdown',
    'markdown-it-py', 'markupsafe', 'matplotlib', 'mdurl', 'meson', 'ml-dtypes', 'mpi4py',
    'mpmath', 'msgpack', 'multidict', 'multipledispatch', 'mypy-extensions', 'nanobind',
    'narwhals', 'networkx', 'ninja', 'numba', 'numba-cuda', 'numpy', 'numpyro', 'nvidia-cublas',
    'nvidia-cuda-cupti', 'nvidia-cuda-nvrtc', 'nvidia-cuda-runtime', 'nvidia-cudnn-cu13',
    'nvidia-cufft', 'nvidia-cufile', 'nvidia-curand', 'nvidia-cusolver', 'nvidia-cusparse',
    'nvidia-cusparselt-cu13', 'nvidia-ml-py', 'nvidia-nccl-cu13', 'nvidia-nvjitlink',
    'nvidia-nvshmem-cu13', 'nvidia-nvtx', 'onnx', 'onnx-ir', 'onnxruntime', 'onnxscript',
    'opencv-python-headless', 'optax', 'opt-einsum', 'opt-einsum-fx', 'optimistix',
    'orbax-checkpoint', 'packaging', 'pandas', 'pathspec', 'patsy', 'peft', 'pillow', 'pip',
    'pluggy', 'portalocker', 'prometheus-client', 'propcache', 'protobuf', 'psutil', 'pyarrow',
    'pybind11', 'py-cpuinfo', 'pygments', 'pyparsing', 'pyproject-hooks', 'pyre-extensions',
    'pytest', 'pytest-benchmark', 'pytest-cov', 'pytest-mock', 'pytest-timeout', 'pytest-xdist',
    'python-dateutil', 'pytorch-lightning', 'pyyaml', 'regex', 'requests', 'rich', 'sacrebleu',
    'safetensors', 'scikit-build-core', 'scikit-image', 'scikit-learn', 'scipy', 'seaborn',
    'sentencepiece', 'sentence-transformers', 'setuptools', 'shellingham', 'simplejson', 'six',
    'sortedcontainers', 'statsmodels', 'sympy', 'tabulate', 'tensorboard',
    'tensorboard-data-server', 'tensorstore', 'threadpoolctl', 'tifffile', 'tiktoken', 'timm',
    'tokenizers', 'toolz', 'torch', 'torchaudio', 'torchdiffeq', 'torch-geometric',
    'torchmetrics', 'torchvision', 'tqdm', 'transformers', 'treescope', 'triton', 'typer',
    'typing-extensions', 'typing-inspect', 'urllib3', 'uvloop', 'wadler-lindig', 'werkzeug',
    'wheel', 'wrapt', 'xarray', 'xxhash', 'yarl', 'zipp',
))


def canonical(name: str) -> str:
    """PEP 503 normalized distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


# -- the test models ---------------------------------------------------------------------

#: Tokenizer files copied from the SmolLM2 fixture (scripts/make_test_models.py --only hf):
#: a real byte-level BPE that llama.cpp's converter recognises ("smollm").
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")
TOKENIZER_REQUIRED = ("tokenizer.json", "tokenizer_config.json")
#: The tiny Llama made on the GPU machine (random weights: it tests code paths, not
#: answers). Every dimension a multiple of 128 (EXL3's tiles); head_dim 64 has
#: flash-attention kernels in llama.cpp and both ExLlamas.
TINY_LLAMA: dict[str, Any] = {
    "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
TINY_SEED = 1234
EXL_BITS = 4.0
