#!/usr/bin/env python3
"""Fails when the crate's modules depend on each other in a cycle (non-test code).

Two levels are checked, both from the `crate::`, `super::` and `self::` paths in `src/`:
- top-level modules (`crate::cache`, `crate::read`, ...): dependencies must point one way;
- sibling files inside each folder (`cache/store.rs` vs `cache/hub.rs`): the same.

A folder's `mod.rs` is its facade: it declares and re-exports its children, so a child's use
of its parent is not an edge. Everything inside `#[cfg(test)]` items is ignored (tests may use
whatever they test). Prints each cycle with one file and line per edge, so it says what to move.

Usage: module-cycles.py [SRC_DIR]   (default: src)
"""

import os
import re
import sys
from collections import defaultdict

SRC = sys.argv[1] if len(sys.argv) > 1 else "src"


def module_of(rel):
    """`cache/store.rs` -> ('cache', 'store'); `cache/mod.rs` -> ('cache',); `lib.rs` -> ()."""
    parts = rel[:-3].split(os.sep)
    if parts[-1] in ("mod", "lib", "main"):
        parts = parts[:-1]
    return tuple(parts)


def strip_tests(text):
    """Blanks out `#[cfg(test)]` items (a module or a function), keeping line numbers."""
    out = list(text)
    for m in re.finditer(r"#\[cfg\(test\)\]", text):
        i = m.end()
        # The item runs to its matching closing brace, or to `;` for `mod x;`/`use`.
        depth = 0
        j = i
        while j < len(text):
            c = text[j]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    break
            elif c == ";" and depth == 0:
                break
            j += 1
        for k in range(m.start(), min(j + 1, len(text))):
            if out[k] != "\n":
                out[k] = " "
    return "".join(out)


def strip_comments_and_strings(text):
    text = re.sub(r"//[^\n]*", lambda m: " " * len(m.group()), text)
    text = re.sub(r"/\*.*?\*/", lambda m: re.sub(r"[^\n]", " ", m.group()), text, flags=re.S)
    text = re.sub(r'"(?:\\.|[^"\\])*"', lambda m: re.sub(r"[^\n]", " ", m.group()), text)
    return text


def expand_use_groups(text):
    """Yields (line, path) for `crate::a::{b, c::d}` groups and plain paths."""
    out = []
    for m in re.finditer(r"\b(crate|super|self)((?:::\w+)*)::\{", text):
        # Find the matching brace.
        start = m.end()
        depth = 1
        j = start
        while j < len(text) and depth:
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
            j += 1
        inner = text[start : j - 1]
        line = text.count("\n", 0, m.start()) + 1
        prefix = m.group(1) + m.group(2)
        # Only the first segment of each item matters for module resolution; nested groups
        # are expanded one level, which covers how this crate writes them.
        depth = 0
        item = ""
        items = []
        for c in inner:
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
            if c == "," and depth == 0:
                items.append(item)
                item = ""
            else:
                item += c
        items.append(item)
        for it in items:
            it = it.strip()
            if not it or it == "self":
                out.append((line, prefix))
                continue
            head = re.match(r"[\w:]+", it)
            if head:
                out.append((line, prefix + "::" + head.group().rstrip(":")))
    for m in re.finditer(r"\b(crate|super|self)((?:::\w+)+)", text):
        line = text.count("\n", 0, m.start()) + 1
        out.append((line, m.group(1) + m.group(2)))
    return out


def main():
    files = {}
    for root, _, names in os.walk(SRC):
        for n in names:
            if n.endswith(".rs"):
                p = os.path.join(root, n)
                files[module_of(os.path.relpath(p, SRC))] = p
    modules = set(files)

    # A folder's facade re-exports (`pub use store::{ResourceCache, ..}` in `cache/mod.rs`):
    # a path through the facade is a dependency on the child that defines the name.
    reexports = defaultdict(dict)
    for cur, path in files.items():
        if not path.endswith("mod.rs"):
            continue
        text = strip_comments_and_strings(strip_tests(open(path, encoding="utf-8").read()))
        for m in re.finditer(r"pub use ([\w:]+?)(?:::\{([^}]*)\}|::(\w+))\s*;", text):
            base = m.group(1).split("::")
            names = [n.strip().split(" as ")[-1] for n in (m.group(2) or m.group(3)).split(",")]
            if base[0] == "crate":
                target = tuple(base[1:])
            elif base[0] == "self":
                target = cur + tuple(base[1:])
            else:
                target = cur + tuple(base)
            while target and target not in modules:
                target = target[:-1]
            for n in names:
                if n and target and target != cur:
                    reexports[cur][n] = target

    def resolve(cur, path):
        segs = path.split("::")
        if segs[0] == "crate":
            base = ()
        elif segs[0] == "self":
            base = cur
        else:  # super (possibly repeated)
            base = cur
            while segs and segs[0] == "super":
                base = base[:-1]
                segs = segs[1:]
            segs = ["x"] + segs
        mod = base
        for s in segs[1:]:
            if mod + (s,) in modules:
                mod = mod + (s,)
            else:
                mod = reexports.get(mod, {}).get(s, mod)
                break
        return mod

    top = defaultdict(dict)  # a -> b -> (file, line)
    sib = defaultdict(dict)
    for cur, path in files.items():
        text = open(path, encoding="utf-8").read()
        text = strip_comments_and_strings(strip_tests(text))
        for line, p in expand_use_groups(text):
            dst = resolve(cur, p)
            where = (os.path.relpath(path), line)
            if cur and dst and cur[0] != dst[0]:
                top[cur[0]].setdefault(dst[0], where)
            # Siblings: the same parent folder, different children.
            n = min(len(cur), len(dst))
            k = 0
            while k < n and cur[k] == dst[k]:
                k += 1
            if k < len(cur) and k < len(dst) and k >= 1:
                a, b = cur[: k + 1], dst[: k + 1]
                sib[a].setdefault(b, where)

    def components(graph):
        """Strongly connected components with more than one module (Tarjan)."""
        index, low, on, stack, out = {}, {}, set(), [], []
        nodes = sorted(set(graph) | {b for v in graph.values() for b in v})

        def visit(v):
            index[v] = low[v] = len(index)
            stack.append(v)
            on.add(v)
            for w in sorted(graph.get(v, {})):
                if w not in index:
                    visit(w)
                    low[v] = min(low[v], low[w])
                elif w in on:
                    low[v] = min(low[v], index[w])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))

        sys.setrecursionlimit(10000)
        for v in nodes:
            if v not in index:
                visit(v)
        return out

    fmt = lambda m: m if isinstance(m, str) else "::".join(m)
    bad = 0
    for name, graph in (("top-level modules", top), ("sibling files", sib)):
        for comp in components(graph):
            bad += 1
            print(f"cycle between {name}: {', '.join(fmt(m) for m in comp)}")
            for a in comp:
                for b, (f, l) in sorted(graph.get(a, {}).items()):
                    if b in comp:
                        print(f"    {fmt(a)} -> {fmt(b)}  ({f}:{l})")
    if bad:
        print(f"{bad} module dependency cycle(s)")
        return 1
    edges = sum(len(v) for v in top.values())
    print(f"no module dependency cycles ({len(files)} files, {edges} top-level edges)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
