#!/usr/bin/env python3
"""The size targets of docs/ARCHITECTURE.md over the tree's C++ sources:
source files over 1,000 lines, classes over 600 lines and functions over 150
lines (bodies found by brace matching, strings and comments skipped; a
heuristic, not a parser). Prints what is over, largest first; exits 0.

  tools/size_report.py [--files N] [--classes N] [--functions N] [DIR ...]
"""
import argparse
import os
import re
import subprocess
import sys

DEF = re.compile(r'^\s*(?:template\s*<[^>]*>\s*)?(?:[\w:<>,*&\s~]+?\s+)?([\w:~]+)\s*\([^;{}]*\)\s*'
                 r'(?:const\s*)?(?:noexcept\s*)?(?:override\s*)?(?:->\s*[\w:<>]+\s*)?(?::[^{;]*)?\{\s*$')
CLASS = re.compile(r'^\s*(?:class|struct)\s+([\w:]+)[^;]*\{\s*$')
KEYWORDS = {'if', 'for', 'while', 'switch', 'catch', 'return', 'else', 'do'}


def strip(line, state):
    """Removes comments and string contents; `state` carries block comments."""
    out, i = [], 0
    while i < len(line):
        if state['block']:
            j = line.find('*/', i)
            if j < 0:
                return ''.join(out)
            state['block'] = False
            i = j + 2
        elif line.startswith('//', i):
            break
        elif line.startswith('/*', i):
            state['block'] = True
            i += 2
        elif line[i] in '"\'':
            q, i = line[i], i + 1
            while i < len(line) and line[i] != q:
                i += 2 if line[i] == '\\' else 1
            i += 1
            out.append('""')
        else:
            out.append(line[i])
            i += 1
    return ''.join(out)


def spans(path):
    lines = open(path, encoding='utf-8', errors='replace').read().split('\n')
    state = {'block': False}
    clean = [strip(l, state) for l in lines]
    found = []
    for i, l in enumerate(clean):
        m = CLASS.match(l) or DEF.match(l)
        # A definition's head may span lines: join up to 4 previous lines.
        if not m and l.rstrip().endswith('{'):
            head = ' '.join(x.strip() for x in clean[max(0, i - 4):i + 1])
            tail = head[head.rfind(';') + 1:] if ';' in head else head
            tail = tail[tail.rfind('}') + 1:] if '}' in tail else tail
            m = DEF.match(tail)
        if not m:
            continue
        name = m.group(1)
        if name.split('::')[-1] in KEYWORDS:
            continue
        kind = 'class' if CLASS.match(l) else 'function'
        depth, j = 0, i
        while j < len(clean):
            depth += clean[j].count('{') - clean[j].count('}')
            if depth <= 0:
                break
            j += 1
        found.append((kind, name, i + 1, j - i + 1))
    return len(lines), found


def main():
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--files', type=int, default=1000)
    ap.add_argument('--classes', type=int, default=600)
    ap.add_argument('--functions', type=int, default=150)
    ap.add_argument('dirs', nargs='*', default=['common', 'coordinator', 'worker', 'tools'])
    a = ap.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files = subprocess.check_output(['git', 'ls-files', '--'] + a.dirs, cwd=root, text=True).split()
    big_files, big = [], []
    for f in files:
        if not f.endswith(('.cc', '.h')):
            continue
        n, found = spans(os.path.join(root, f))
        if n > a.files:
            big_files.append((n, f))
        for kind, name, line, size in found:
            limit = a.classes if kind == 'class' else a.functions
            if size > limit:
                big.append((size, kind, name, f'{f}:{line}'))
    print(f'files over {a.files} lines: {len(big_files)}')
    for n, f in sorted(big_files, reverse=True):
        print(f'  {n:5d}  {f}')
    print(f'classes over {a.classes} lines, functions over {a.functions}: {len(big)}')
    for size, kind, name, where in sorted(big, reverse=True):
        print(f'  {size:5d}  {kind:8s} {name}  ({where})')
    return 0


if __name__ == '__main__':
    sys.exit(main())
