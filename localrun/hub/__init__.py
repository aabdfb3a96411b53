"""The Hugging Face Hub: find a model's variant for an engine, plan the fit, download.

The only package that imports ``huggingface_hub``; import it lazily (``import localrun``
must not pull it in). Two steps, so a plan can be shown before any byte moves:

    plan = plan_fetch("qwen2.5:0.5b", backend="llama.cpp", memory_budget_bytes=8 * 2**30)
    plan.require_fit()           # ModelTooLargeError with the numbers, before downloading
    path = fetch(plan, progress=callback)   # the .gguf file or the model folder

Downloads go into the standard HF cache (``HF_HOME``/``HF_HUB_CACHE``), from the commit
the plan listed. Files on plain HTTP (the Hub's 302 to its CDN) are fetched by localrun
into ``blobs/<etag>.localrun.incomplete`` and continued with Range requests after a
dropped connection, an expired signed URL or a killed process; their LFS sha256 is
checked before the blob takes its name, and huggingface_hub links it into the snapshot.
Xet-backed files go through ``hf_hub_download`` (hf_xet), checked after. Both report
progress through the same meter, and both are tried again on 5xx, 429 (Retry-After) and
dropped connections. A disk-space check, and errors that say what to do.
With ``HF_HUB_OFFLINE=1`` (or no network) plans are made from the cache,
and what is missing is named: a name that was downloaded before (an alias, a base repo
id) is planned from what that download resolved it to (:mod:`localrun.hub.pulls`).

Catalog entries are hints, not promises: an entry the Hub no longer has (404, gated, no
usable weights) is passed over with one line in the plan's reasons, and the Hub's model
tree is searched instead. In a repo holding several models (ONNX folders, GGUF files),
only the variants of the requested model size are candidates.

The modules, by job (each imports only those above it):

- ``chosen``: what was chosen to download, as data (Download, PlannedFile, QuantOption).
- ``pulls``: what each download resolved a name to (plain file I/O; localrun's home).
- ``progress``: DownloadProgress reports and the byte meter both download paths share.
- ``client``: reachability, the cache folder, retries and typed errors, Range reads.
- ``listing``: a repo's files at one commit (Hub or cache); records of earlier downloads.
- ``variants``: variant discovery: formats, variants in a repo, quant tags, model sizes,
  which repos to look in.
- ``fit``: planning tables (DEFAULT_TARGET), the model's shape, the memory fit, the
  choice among variants, models that need no download.
- ``planner``: :func:`plan_fetch`, a Hub name to a Download.
- ``resumable``: localrun's resumable HTTP download into the HF cache.
- ``download``: :func:`fetch`, a Download to files in the cache, checked.
- ``cache``: listing and removing cached models.

Re-exported here: what other modules and tests use. Knobs that tests patch
(``client.RETRY_BACKOFF``, ``fit.GGUF_HEADER_READS``) are patched where they are read,
in their own module, so they are not re-exported (a patch here would change nothing).
"""

from __future__ import annotations

from collections.abc import Sequence

from localrun.hub.cache import (
    Removal,
    cached_models,
    plan_removal,
    pulled_backends,
    remove,
)
from localrun.hub.chosen import (
    Download,
    PlannedFile,
    QuantOption,
    Source,
    describe_options,
)
from localrun.hub.client import HUB_ATTEMPTS
from localrun.hub.download import fetch
from localrun.hub.fit import DEFAULT_TARGET, fmt_target
from localrun.hub.listing import record_name
from localrun.hub.planner import DEFAULT_BACKEND, default_backend, plan_fetch
from localrun.hub.progress import DownloadProgress, ProgressCallback
from localrun.hub.resumable import PARTIAL_SUFFIX, sha256_file
from localrun.hub.variants import (
    GGUF_BPW,
    GGUF_IGNORE,
    TRUSTED_QUANTIZERS,
    device_kind,
    gguf_quant,
    keep_model_size,
    model_size,
    model_sizes,
    ov_missing,
    quant_matches,
    repo_format,
    unusable,
)

__all__: Sequence[str] = (
    "DEFAULT_BACKEND",
    "DEFAULT_TARGET",
    "GGUF_BPW",
    "GGUF_IGNORE",
    "HUB_ATTEMPTS",
    "PARTIAL_SUFFIX",
    "TRUSTED_QUANTIZERS",
    "Download",
    "DownloadProgress",
    "PlannedFile",
    "ProgressCallback",
    "QuantOption",
    "Removal",
    "Source",
    "cached_models",
    "default_backend",
    "describe_options",
    "device_kind",
    "fetch",
    "fmt_target",
    "gguf_quant",
    "keep_model_size",
    "model_size",
    "model_sizes",
    "ov_missing",
    "plan_fetch",
    "plan_removal",
    "pulled_backends",
    "quant_matches",
    "record_name",
    "remove",
    "repo_format",
    "sha256_file",
    "unusable",
)
