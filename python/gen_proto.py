#!/usr/bin/env python3
"""Generates the detour Python package's protobuf and gRPC modules.

Run by the CMake build (python/CMakeLists.txt), never by hand in the source
tree: nothing generated is committed.

    gen_proto.py --proto_path DIR --out PKG_DIR --protos P... --services P...
                 (--protoc PROTOC --grpc_plugin PLUGIN | --grpc_tools)

Writes PKG_DIR/_proto/ (PKG_DIR is the build tree's python/detour): one
module per .proto under its own path (_proto/detour/v1/job_service_pb2.py,
plus _pb2_grpc.py for the --services files and .pyi type stubs when protoc
can make them), with the imports protoc writes ("from detour.v1 import
spec_pb2") rewritten to point inside the package
("from detour._proto.detour.v1 import spec_pb2"), so the generated code never
needs its own top-level packages on sys.path. The result replaces the old
_proto/ in one rename, and is imported once at the end as a check that the
Python protobuf runtime accepts what protoc wrote.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

PACKAGE = "detour._proto"


def proto_packages(protos):
    """The Python packages protoc makes: 'detour/v1/spec.proto' -> 'detour.v1'."""
    return sorted({os.path.dirname(p).replace("/", ".") for p in protos})


def rewrite(text, packages):
    """Points the generated imports and module names inside PACKAGE."""
    alternatives = "|".join(re.escape(p) for p in packages)
    # from detour.v1 import spec_pb2 as ...
    text = re.sub(r"^(\s*)from (%s) import " % alternatives,
                  lambda m: "%sfrom %s.%s import " % (m.group(1), PACKAGE, m.group(2)),
                  text, flags=re.MULTILINE)
    # 'detour.v1.job_service_pb2' (the module name the builder gives classes)
    text = re.sub(r"(['\"])(%s)\.(\w+_pb2)\1" % alternatives,
                  lambda m: "%s%s.%s.%s%s" % (m.group(1), PACKAGE, m.group(2), m.group(3),
                                              m.group(1)),
                  text)
    return text


def run_protoc(args, proto_path, out, protos, services):
    include = []
    if args.grpc_tools:
        import grpc_tools  # pylint: disable=import-outside-toplevel
        from grpc_tools import protoc  # pylint: disable=import-outside-toplevel
        include = ["-I" + os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")]

        def call(argv):
            return protoc.main(["protoc"] + argv)
    else:
        def call(argv):
            return subprocess.call([args.protoc] + argv)

    common = ["-I" + proto_path] + include
    if call(common + ["--python_out=" + out] + pyi_flag(args, out) + protos) != 0:
        sys.exit("gen_proto.py: protoc failed on %s" % " ".join(protos))
    grpc_flags = ["--grpc_python_out=" + out]
    if not args.grpc_tools:
        grpc_flags.append("--plugin=protoc-gen-grpc_python=" + args.grpc_plugin)
    if call(common + grpc_flags + services) != 0:
        sys.exit("gen_proto.py: the gRPC Python plugin failed on %s" % " ".join(services))


def pyi_flag(args, out):
    # Type stubs need protoc >= 3.20; the one bundled with old grpc_tools lacks them.
    if args.grpc_tools:
        return []
    version = subprocess.run([args.protoc, "--version"], capture_output=True, text=True,
                             check=False).stdout.split()
    try:
        major_minor = tuple(int(x) for x in version[-1].split(".")[:2])
    except (IndexError, ValueError):
        return []
    return ["--pyi_out=" + out] if major_minor >= (3, 20) else []


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--proto_path", required=True)
    parser.add_argument("--out", required=True, help="the package directory (…/python/detour)")
    parser.add_argument("--protos", nargs="+", required=True)
    parser.add_argument("--services", nargs="*", default=[])
    parser.add_argument("--protoc")
    parser.add_argument("--grpc_plugin")
    parser.add_argument("--grpc_tools", action="store_true",
                        help="use grpc_tools.protoc instead of --protoc and --grpc_plugin")
    parser.add_argument("--stamp", help="file touched after success")
    args = parser.parse_args()
    if not args.grpc_tools and not (args.protoc and args.grpc_plugin):
        parser.error("give --protoc and --grpc_plugin, or --grpc_tools")

    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".proto-", dir=args.out)
    try:
        raw = os.path.join(work, "raw")
        os.mkdir(raw)
        run_protoc(args, os.path.abspath(args.proto_path), raw, args.protos, args.services)
        packages = proto_packages(args.protos)
        staged = os.path.join(work, "_proto")
        for dirpath, _, files in os.walk(raw):
            rel = os.path.relpath(dirpath, raw)
            target = os.path.normpath(os.path.join(staged, rel))
            os.makedirs(target, exist_ok=True)
            for name in files:
                with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                    text = f.read()
                with open(os.path.join(target, name), "w", encoding="utf-8") as f:
                    f.write(rewrite(text, packages))
        # Every directory is a regular package.
        for dirpath, _, files in os.walk(staged):
            if "__init__.py" not in files:
                with open(os.path.join(dirpath, "__init__.py"), "w", encoding="utf-8") as f:
                    f.write("# Generated by python/gen_proto.py. DO NOT EDIT.\n")
        final = os.path.join(args.out, "_proto")
        old = os.path.join(work, "old")
        if os.path.exists(final):
            os.rename(final, old)
        os.rename(staged, final)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    # The runtime must accept what protoc wrote (old runtimes reject new code).
    check = ("import sys; sys.path.insert(0, %r); " % os.path.dirname(os.path.abspath(args.out)) +
             "; ".join("import %s.%s.%s_pb2" % (PACKAGE, os.path.dirname(p).replace("/", "."),
                                                 os.path.basename(p)[:-len(".proto")])
                       for p in args.protos))
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                            check=False)
    if result.returncode != 0:
        sys.exit("gen_proto.py: %s cannot import the generated modules (is its protobuf "
                 "runtime older than protoc?):\n%s" % (sys.executable, result.stderr))
    if args.stamp:
        with open(args.stamp, "w", encoding="utf-8") as f:
            f.write("ok\n")


if __name__ == "__main__":
    main()
