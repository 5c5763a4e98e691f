"""Keep committed notebooks clean: drop volatile metadata, keep outputs (the course reads on GitHub)."""

import json
import sys

KEEP_NOTEBOOK_META = {"kernelspec", "language_info"}


def clean(path: str) -> None:
    with open(path) as f:
        nb = json.load(f)
    nb["metadata"] = {k: v for k, v in nb.get("metadata", {}).items() if k in KEEP_NOTEBOOK_META}
    nb["metadata"].get("language_info", {}).pop("version", None)
    for cell in nb["cells"]:
        cell["metadata"] = {k: v for k, v in cell.get("metadata", {}).items() if k in {"tags"}}
        cell.pop("id", None) if nb.get("nbformat_minor", 0) < 5 else None
    with open(path, "w") as f:
        json.dump(nb, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    for p in sys.argv[1:]:
        clean(p)
