"""bench/gpu_session.sh --cpu-smoke puts this folder first on PYTHONPATH: every Python process it
starts (spawned children too) then finds none of the packages the GPU machine lacks
(/work/.library/device/KINDS.md lists what it has), so a script that would need one there fails
here first. Hidden at the path finder, so `importlib.util.find_spec` answers None, as there."""

import importlib.machinery

ABSENT = frozenset(
    (
        "ray",
        "fastapi",
        "starlette",
        "uvicorn",
        "multipart",
        "pydantic",
        "gguf",
        "flash_attn",
        "llguidance",
    )
)
_find_spec = importlib.machinery.PathFinder.find_spec.__func__


def _hidden_find_spec(cls, name, path=None, target=None):
    if name.partition(".")[0] in ABSENT:
        return None
    return _find_spec(cls, name, path, target)


importlib.machinery.PathFinder.find_spec = classmethod(_hidden_find_spec)
