"""nvcc relocatable-device-code compile + device link of the CUDA sources.

cuda_device_link(name, srcs, hdrs) produces `lib<name>.a` holding one object
per .cu source (nvcc -rdc=true -c) plus `<name>_dlink.o` (nvcc -dlink against
NVSHMEM's libnvshmem_device.a), and `<name>.manifest`, a text file the check
test (//tools/bazel:check_cuda_archive.sh) reads:

    status available|unavailable|empty
    reason <text>             (unavailable only)
    nvcc <version line>
    source <path> <object>    (one per source)
    dlink <object>
    undefined <object> <symbol> <path>     (expect_undefined: the object must reference it)
    compiled <object> <path> <text>        (compile_checks: compiling <path> proved <text>)

NVSHMEM defaults to the venv's wheel (@local_cuda); `nvshmem_headers` and
`nvshmem_device_lib` select another tree (@nvshmem_qp).
"""

load(
    "@local_cuda//:defs.bzl",
    "CCCL_INCLUDE",
    "CUDA_AVAILABLE",
    "CUDA_UNAVAILABLE_REASON",
    "NVCC_VERSION",
)

CUDA_ARCH = "sm_90"

def _object_name(src):
    # cuda/foo.cu -> foo.o ; keeps names unique within one package.
    return src.basename[:-len(src.extension) - 1] + ".o"

def _cuda_device_link_impl(ctx):
    srcs = [f for f in ctx.files.srcs if f.extension == "cu"]
    by_basename = {s.basename: s for s in srcs}
    for key in list(ctx.attr.expect_undefined.keys()) + list(ctx.attr.compile_checks.keys()):
        if key not in by_basename:
            fail("%s: '%s' is not the basename of a .cu file in srcs (%s)" % (
                ctx.label,
                key,
                ", ".join(sorted(by_basename.keys())),
            ))
    archive = ctx.outputs.archive
    manifest = ctx.outputs.manifest

    if not srcs or not CUDA_AVAILABLE:
        status = "empty" if not srcs else "unavailable"
        lines = ["status " + status]
        if status == "unavailable":
            lines.append("reason " + CUDA_UNAVAILABLE_REASON)
        lines.append("nvcc " + NVCC_VERSION)
        lines.extend(["pending %s" % s.short_path for s in srcs])
        ctx.actions.write(manifest, "\n".join(lines) + "\n")
        ctx.actions.write(archive, "!<arch>\n")  # a valid empty ar archive
        return [DefaultInfo(files = depset([archive, manifest]))]

    nvcc = ctx.executable._nvcc
    nvshmem_headers = ctx.files.nvshmem_headers
    if len(ctx.files.nvshmem_device_lib) != 1:
        fail("%s: nvshmem_device_lib %s must be exactly one libnvshmem_device.a, got %s" % (
            ctx.label,
            ctx.attr.nvshmem_device_lib.label,
            [f.path for f in ctx.files.nvshmem_device_lib],
        ))
    nvshmem_lib = ctx.files.nvshmem_device_lib[0]
    nvshmem_include = nvshmem_lib.dirname.rsplit("/", 1)[0] + "/include"

    include_flags = [
        "-I.",
        "-I" + ctx.bin_dir.path,
        "-I" + nvshmem_include,
    ]
    if CCCL_INCLUDE:
        include_flags.append("-I" + CCCL_INCLUDE)
    xla_includes = depset(transitive = [
        dep[CcInfo].compilation_context.includes
        for dep in ctx.attr.deps
        if CcInfo in dep
    ] + [
        dep[CcInfo].compilation_context.system_includes
        for dep in ctx.attr.deps
        if CcInfo in dep
    ])
    for inc in xla_includes.to_list():
        include_flags.append("-I" + inc)
    dep_headers = depset(transitive = [
        dep[CcInfo].compilation_context.headers
        for dep in ctx.attr.deps
        if CcInfo in dep
    ])

    objects = []
    manifest_lines = ["status available", "nvcc " + NVCC_VERSION]
    for src in srcs:
        obj = ctx.actions.declare_file("_objs/%s/%s" % (ctx.label.name, _object_name(src)))
        objects.append(obj)
        manifest_lines.append("source %s %s" % (src.short_path, obj.basename))
        for sym in ctx.attr.expect_undefined.get(src.basename, []):
            manifest_lines.append("undefined %s %s %s" % (obj.basename, sym, src.short_path))
        if src.basename in ctx.attr.compile_checks:
            manifest_lines.append("compiled %s %s %s" % (
                obj.basename,
                src.short_path,
                ctx.attr.compile_checks[src.basename].replace("\n", " "),
            ))
        args = ctx.actions.args()
        args.add("-std=c++17")
        args.add("-arch=" + CUDA_ARCH)
        args.add("-rdc=true")
        args.add_all(["-Xcompiler", "-fPIC"])
        args.add_all(include_flags)
        args.add_all(ctx.attr.copts)
        args.add("-c", src)
        args.add("-o", obj)
        ctx.actions.run(
            executable = nvcc,
            arguments = [args],
            inputs = depset(
                [src] + ctx.files.hdrs + nvshmem_headers,
                transitive = [dep_headers],
            ),
            outputs = [obj],
            mnemonic = "NvccCompile",
            progress_message = "nvcc -rdc=true -c %s (%s)" % (src.short_path, ctx.label.name),
            use_default_shell_env = True,
        )

    dlink = ctx.actions.declare_file("_objs/%s/%s_dlink.o" % (ctx.label.name, ctx.label.name))
    manifest_lines.append("dlink " + dlink.basename)
    args = ctx.actions.args()
    args.add("-arch=" + CUDA_ARCH)
    args.add("-dlink")
    args.add_all(objects)
    args.add("-L" + nvshmem_lib.dirname)
    args.add("-lnvshmem_device")
    args.add("-o", dlink)
    ctx.actions.run(
        executable = nvcc,
        arguments = [args],
        inputs = objects + [nvshmem_lib],
        outputs = [dlink],
        mnemonic = "NvccDeviceLink",
        progress_message = "nvcc -dlink %d object(s) + %s (%s)" % (len(objects), nvshmem_lib.short_path, ctx.label.name),
        use_default_shell_env = True,
    )

    ar_args = ctx.actions.args()
    ar_args.add("rcsD", archive)
    ar_args.add_all(objects + [dlink])
    ctx.actions.run(
        executable = "ar",
        arguments = [ar_args],
        inputs = objects + [dlink],
        outputs = [archive],
        mnemonic = "NvccArchive",
        progress_message = "ar %s" % archive.short_path,
        use_default_shell_env = True,
    )
    ctx.actions.write(manifest, "\n".join(manifest_lines) + "\n")
    return [DefaultInfo(files = depset([archive, manifest]))]

cuda_device_link = rule(
    implementation = _cuda_device_link_impl,
    outputs = {
        "archive": "lib%{name}.a",
        "manifest": "%{name}.manifest",
    },
    attrs = {
        "srcs": attr.label_list(allow_files = [".cu"]),
        "hdrs": attr.label_list(allow_files = [".cuh", ".h", ".hpp", ".inc"]),
        "deps": attr.label_list(providers = [CcInfo], doc = "Header-only cc_library deps (include paths + headers)."),
        "copts": attr.string_list(),
        "expect_undefined": attr.string_list_dict(
            doc = "{source basename: [symbols]}: the source's object must reference each " +
                  "symbol (nm -u); checked by the archive test.",
        ),
        "compile_checks": attr.string_dict(
            doc = "{source basename: text}: what compiling that source proves (e.g. a " +
                  "static_assert); reported by the archive test.",
        ),
        "nvshmem_headers": attr.label(
            default = "@local_cuda//:nvshmem_headers",
            doc = "NVSHMEM headers (<root>/include/**, next to <root>/lib/libnvshmem_device.a).",
        ),
        "nvshmem_device_lib": attr.label(
            default = "@local_cuda//:nvshmem_device_lib",
            allow_files = [".a"],
            doc = "libnvshmem_device.a; its ../include is put on the include path.",
        ),
        "_nvcc": attr.label(
            default = "@local_cuda//:nvcc.sh",
            executable = True,
            cfg = "host",
            allow_single_file = True,
        ),
    },
    doc = "nvcc -rdc compile of each .cu, nvcc -dlink with libnvshmem_device, archived.",
)
