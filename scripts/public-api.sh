#!/usr/bin/env bash
# The crate's public API, one line per item, from rustdoc's JSON output:
# writes public-api.txt, or with --check fails when it differs from the
# committed file (so a change to the surface shows in review). rustdoc's
# JSON is unstable; RUSTC_BOOTSTRAP lets the pinned stable toolchain emit
# it, and the script checks the format version it was written for.
#
# Every line is the compiler's: each path is the item's canonical one
# (rustdoc's path table, not the name as written in the source, so
# `r2d2::Error` never shows as a bare `Error`), each impl is printed with
# its own `for` type (an impl listed under a type it only mentions is not
# attributed to that type), and the auto traits (`Send`, `Sync`, `Unpin`,
# `UnwindSafe`, `RefUnwindSafe`, `Freeze`) are those rustdoc computed,
# negative ones included: a guard that stops being `Send` changes a line
# and fails `--check`. Blanket impls (`From<T> for T`, `Into`, `Any`…)
# hold for every type and are left out. `--count` prints the number of
# public functions (a trait's methods once, on the trait).
set -euo pipefail
cd "$(dirname "$0")/.."
RUSTC_BOOTSTRAP=1 cargo rustdoc --quiet --all-features --lib -- \
  -Z unstable-options --output-format json
out=$(mktemp)
trap 'rm -f "$out"' EXIT
python3 - "${CARGO_TARGET_DIR:-target}/doc/redmutex.json" > "$out" <<'PY'
import json, sys

FORMAT = 57
doc = json.load(open(sys.argv[1]))
if doc["format_version"] != FORMAT:
    sys.exit("rustdoc JSON format %s, this script reads %s" % (doc["format_version"], FORMAT))
index = doc["index"]

def item(i):
    return index.get(str(i))

def canonical(p):
    """The path of a path reference (`{path, id, args}`): this crate's
    items by the root re-export that makes them public (modules are
    private), others by their canonical path."""
    known = doc["paths"].get(str(p.get("id")))
    if known is None:
        return p["path"]
    if known["crate_id"] == 0:
        return "redmutex::" + known["path"][-1]
    return "::".join(known["path"])

def generic_args(args):
    if not args:
        return ""
    if "angle_bracketed" in args:
        a = args["angle_bracketed"]
        parts = []
        for g in a["args"]:
            if "type" in g:
                parts.append(ty(g["type"]))
            elif "lifetime" in g:
                parts.append(g["lifetime"])
            elif "const" in g:
                parts.append(g["const"].get("expr", "_"))
        for c in a.get("constraints", []):
            binding = c["binding"]
            if "equality" in binding and "type" in binding["equality"]:
                parts.append("%s = %s" % (c["name"], ty(binding["equality"]["type"])))
            else:
                parts.append("%s: %s" % (c["name"], bounds(binding.get("constraint", []))))
        return "<%s>" % ", ".join(parts) if parts else ""
    if "parenthesized" in args:
        p = args["parenthesized"]
        out = "(%s)" % ", ".join(ty(t) for t in p["inputs"])
        if p.get("output"):
            out += " -> " + ty(p["output"])
        return out
    return ""

def bounds(bs):
    out = []
    for b in bs:
        if "trait_bound" in b:
            t = b["trait_bound"]["trait"]
            out.append(canonical(t) + generic_args(t.get("args")))
        elif "outlives" in b:
            out.append(b["outlives"])
        else:
            out.append("?")
    return " + ".join(out)

def ty(t):
    if t is None:
        return "()"
    (kind, v), = t.items()
    if kind == "resolved_path":
        return canonical(v) + generic_args(v.get("args"))
    if kind == "generic" or kind == "primitive":
        return v
    if kind == "borrowed_ref":
        lt = (v["lifetime"] + " ") if v.get("lifetime") else ""
        return "&%s%s%s" % (lt, "mut " if v["is_mutable"] else "", ty(v["type"]))
    if kind == "raw_pointer":
        return "*%s %s" % ("mut" if v["is_mutable"] else "const", ty(v["type"]))
    if kind == "slice":
        return "[%s]" % ty(v)
    if kind == "array":
        return "[%s; %s]" % (ty(v["type"]), v["len"])
    if kind == "tuple":
        return "(%s)" % ", ".join(ty(x) for x in v)
    if kind == "impl_trait":
        return "impl " + bounds(v)
    if kind == "dyn_trait":
        traits = [canonical(p["trait"]) + generic_args(p["trait"].get("args")) for p in v["traits"]]
        if v.get("lifetime"):
            traits.append(v["lifetime"])
        return "dyn " + " + ".join(traits)
    if kind == "qualified_path":
        trait = v.get("trait")
        return "<%s as %s>::%s" % (ty(v["self_type"]), canonical(trait) if trait else "?", v["name"])
    if kind == "function_pointer":
        sig = v["sig"]
        return "fn(%s)%s" % (", ".join(ty(x[1]) for x in sig["inputs"]),
                             (" -> " + ty(sig["output"])) if sig.get("output") else "")
    if kind == "infer":
        return "_"
    return kind

def generics(g):
    params = []
    for p in g.get("params", []):
        k = p["kind"]
        if "lifetime" in k:
            params.append(p["name"])
        elif "type" in k:
            if k["type"].get("is_synthetic"):
                continue
            b = bounds(k["type"].get("bounds", []))
            params.append(p["name"] + (": " + b if b else ""))
        elif "const" in k:
            params.append("const %s: %s" % (p["name"], ty(k["const"]["type"])))
    return "<%s>" % ", ".join(params) if params else ""

def function(name, f):
    sig = f["sig"]
    inputs = []
    for arg, t in sig["inputs"]:
        if arg == "self":
            if t == {"generic": "Self"}:
                inputs.append("self")
            elif "borrowed_ref" in t and t["borrowed_ref"]["type"] == {"generic": "Self"}:
                inputs.append("&mut self" if t["borrowed_ref"]["is_mutable"] else "&self")
            else:
                inputs.append("self: " + ty(t))
        else:
            inputs.append("%s: %s" % (arg, ty(t)))
    out = "fn %s%s(%s)" % (name, generics(f["generics"]), ", ".join(inputs))
    if sig.get("output"):
        out += " -> " + ty(sig["output"])
    return out

def deprecated(it):
    return " #[deprecated]" if it.get("deprecation") else ""

lines = []

def impls(path, ids, owner):
    traits = []
    for i in ids:
        impl = item(i)
        if impl is None:
            continue
        inner = impl["inner"]["impl"]
        if inner.get("blanket_impl"):
            continue
        # rustdoc also lists, under a type, impls for another type that
        # only name it (`From<A> for B` under A): listed under B alone.
        target = inner["for"].get("resolved_path")
        if target is not None and target.get("id") != owner:
            continue
        if inner["trait"] is None:
            # An inherent impl on one instantiation of a generic type
            # (`impl Options<LockExtra>`) is named with its arguments, so
            # each method says which impl it is in.
            on = ty(inner["for"]) if (target or {}).get("args") else path
            for m in inner["items"]:
                mi = item(m)
                if mi is None or mi.get("visibility") != "public":
                    continue
                if "function" in mi["inner"]:
                    lines.append("pub %s%s" % (function(on + "::" + mi["name"], mi["inner"]["function"]), deprecated(mi)))
                elif "assoc_const" in mi["inner"]:
                    lines.append("pub const %s::%s: %s" % (on, mi["name"], ty(mi["inner"]["assoc_const"]["type"])))
        else:
            t = inner["trait"]
            traits.append("impl%s %s%s%s for %s" % (
                generics(inner["generics"]),
                "!" if inner.get("is_negative") else "",
                canonical(t),
                generic_args(t.get("args")),
                ty(inner["for"]),
            ))
    lines.extend(sorted(set(traits)))

def visit(it, path):
    (kind, v), = it["inner"].items()
    if kind == "struct":
        lines.append("pub struct %s%s%s" % (path, generics(v["generics"]), deprecated(it)))
        fields = v["kind"].get("plain", {}).get("fields", [])
        for f in fields:
            fi = item(f)
            if fi and fi.get("visibility") == "public":
                lines.append("%s.%s: %s" % (path, fi["name"], ty(fi["inner"]["struct_field"])))
        impls(path, v["impls"], it["id"])
    elif kind == "enum":
        ne = " #[non_exhaustive]" if any("non_exhaustive" in str(a) for a in it.get("attrs", [])) else ""
        lines.append("pub enum %s%s%s" % (path, generics(v["generics"]), ne))
        for var in v["variants"]:
            vi = item(var)
            vk = vi["inner"]["variant"]["kind"]
            if vk == "plain":
                lines.append("%s::%s" % (path, vi["name"]))
            elif "tuple" in vk:
                lines.append("%s::%s(%s)" % (path, vi["name"], ", ".join(
                    ty(item(f)["inner"]["struct_field"]) if f is not None and item(f) else "_" for f in vk["tuple"])))
            elif "struct" in vk:
                lines.append("%s::%s { %s }" % (path, vi["name"], ", ".join(
                    "%s: %s" % (item(f)["name"], ty(item(f)["inner"]["struct_field"])) for f in vk["struct"]["fields"])))
        impls(path, v["impls"], it["id"])
    elif kind == "function":
        lines.append("pub " + function(path, v) + deprecated(it))
    elif kind == "constant":
        lines.append("pub const %s: %s" % (path, ty(v["type"])))
    elif kind == "trait":
        lines.append("pub trait %s%s" % (path, generics(v["generics"])))
        for m in v["items"]:
            mi = item(m)
            if mi is not None and "function" in mi["inner"]:
                lines.append("pub %s%s" % (function(path + "::" + mi["name"], mi["inner"]["function"]), deprecated(mi)))
    elif kind == "type_alias":
        lines.append("pub type %s%s = %s" % (path, generics(v["generics"]), ty(v["type"])))
    elif kind == "module":
        for i in v["items"]:
            sub = item(i)
            if sub and sub.get("visibility") == "public" and sub.get("name"):
                visit(sub, "%s::%s" % (path, sub["name"]))
    else:
        lines.append("pub %s %s" % (kind, path))

root = item(doc["root"])
def root_name(i):
    it = item(i) or {}
    u = it.get("inner", {}).get("use")
    return (u["name"] if u else it.get("name")) or ""
for i in sorted(root["inner"]["module"]["items"], key=root_name):
    it = item(i)
    if it is None or it.get("visibility") != "public":
        continue
    if "use" in it["inner"]:
        u = it["inner"]["use"]
        target = item(u["id"]) if u.get("id") is not None else None
        name = "redmutex::" + u["name"]
        if target is None or "module" in target["inner"] and target.get("crate_id", 0) != 0:
            lines.append("pub use %s as %s" % (u["source"], name))
            continue
        visit(target, name)
    elif it.get("name"):
        visit(it, "redmutex::" + it["name"])
print("\n".join(lines))
PY
if [ "${1:-}" = "--count" ]; then
  echo "$(grep -c '^pub fn' "$out") public functions"
elif [ "${1:-}" = "--check" ]; then
  if ! diff -u public-api.txt "$out"; then
    echo "error: the public API changed; run scripts/public-api.sh and commit public-api.txt" >&2
    exit 1
  fi
  echo "public-api.txt is up to date ($(wc -l < public-api.txt) items)"
else
  cp "$out" public-api.txt
  echo "wrote public-api.txt ($(wc -l < public-api.txt) items)"
fi
