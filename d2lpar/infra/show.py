"""Show the real source of a function or class on the page: what the reader sees is what runs.

A notebook that builds an algorithm in d2lpar prints it with ``show(obj)``, so a student follows the
code without opening the package. In JupyterLab the source is highlighted (HTML); nbval and a plain
terminal get the same text, with a first line saying where it lives (``d2lpar/...py, lines a-b``).
Something without Python source (a builtin, a C function, a lambda made from a string by ``eval``)
raises ``ValueError`` with one sentence saying so.
"""

from __future__ import annotations

import html
import inspect
import textwrap
from pathlib import Path

__all__ = ["Source", "source_of", "show"]


class Source:
    """A piece of source with where it lives; shown as highlighted HTML or as plain text."""

    def __init__(self, text: str, where: str):
        self.text, self.where = text, where

    def __repr__(self) -> str:
        return f"# {self.where}\n{self.text.rstrip()}"

    def _repr_html_(self) -> str:
        try:
            from pygments import highlight
            from pygments.formatters import HtmlFormatter
            from pygments.lexers import PythonLexer
        except ImportError:   # pygments comes with IPython; without it, plain text in a <pre>
            return f"<pre>{html.escape(repr(self))}</pre>"
        style = HtmlFormatter(style="default").get_style_defs(".d2lpar-src")
        body = highlight(self.text, PythonLexer(), HtmlFormatter(cssclass="d2lpar-src"))
        return (f"<style>{style}</style><div style='font-size:small;color:#666'>"
                f"{html.escape(self.where)}</div>{body}")


def _where(obj) -> str:
    path = Path(inspect.getsourcefile(obj) or "?")
    parts = path.parts
    if "d2lpar" in parts:   # relative to the checkout, never this machine's folders
        path = Path(*parts[len(parts) - 1 - parts[::-1].index("d2lpar"):])
    else:
        path = Path(path.name)
    lines, first = inspect.getsourcelines(obj)
    first = max(first, 1)   # a whole module is reported from line 0
    return f"{path.as_posix()}, lines {first}-{first + len(lines) - 1}"


def source_of(obj) -> Source:
    """The source of a module, class, function or method, or ValueError saying why there is none."""
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or repr(obj)
    if isinstance(obj, property):
        obj = obj.fget
    if callable(obj) and not inspect.isclass(obj):
        obj = inspect.unwrap(obj)   # a decorated function (``@torch.no_grad()``): show its own code
    if inspect.isbuiltin(obj) or (callable(obj) and not inspect.isclass(obj)
                                  and not hasattr(inspect.unwrap(obj), "__code__")
                                  and not inspect.ismethod(obj)):
        raise ValueError(f"show({name}): it has no Python source (a builtin or C function); "
                         f"read its documentation with help({name}) instead")
    try:
        text = textwrap.dedent(inspect.getsource(obj))
        where = _where(obj)
    except (OSError, TypeError) as e:
        raise ValueError(f"show({name}): its source is not in any file (made by exec or eval of a "
                         f"string, or in a compiled module), so it cannot be shown ({e})") from None
    return Source(text, where)


def show(*objs) -> None:
    """Display the source of each object (highlighted in JupyterLab, plain under nbval)."""
    for obj in objs:
        src = source_of(obj)
        try:
            from IPython.display import display
            display(src)
        except ImportError:
            print(repr(src))
