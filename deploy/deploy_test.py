"""Checks the deployment files in deploy/ without a cluster: the Kubernetes manifests parse and hang
together (selectors, services, secrets), the systemd units, the Slurm script and the clean-Debian
check are well formed, and every flag any of them passes to `pathways` is one that `pathways help`
lists for that command.

Run by CTest (deploy.files); PATHWAYS_BINARY names the binary whose help is the reference."""
import os
import re
import shutil
import subprocess

import pytest
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
COMMANDS = ("controller", "worker", "status", "demo", "tenant", "train")
INVOCATION = re.compile(r'(?:/usr/bin/pathways|"?\$PATHWAYS"?|\bpathways)\s+(' + "|".join(COMMANDS) + r')\b([^\n&;|]*)')


def read(*path):
    with open(os.path.join(HERE, *path)) as f:
        return f.read()


@pytest.fixture(scope="module")
def known_flags():
    """Flags per command, as `pathways help` lists them (and the ones it says every command takes)."""
    out = subprocess.run([os.environ["PATHWAYS_BINARY"], "help"], capture_output=True, text=True, timeout=60)
    text = out.stdout + out.stderr
    flags = {c: set() for c in COMMANDS}
    current = None
    for line in text.splitlines():
        m = re.match(r"  (\w+) ", line)
        if m and m.group(1) in COMMANDS:
            current = m.group(1)
        elif not line.startswith("   "):
            current = None
        if current:
            flags[current].update(re.findall(r"--([a-z][a-z0-9-]*)", line))
    assert flags["controller"] and flags["worker"], text
    # The flags the help gives for several commands at once, in its closing lines.
    every = re.search(r"^Every command takes (.*)$", text, re.M)
    assert every, text
    for c in COMMANDS:
        flags[c].update(re.findall(r"--([a-z][a-z0-9-]*)", every.group(1)))
    tls = re.search(r"Controller and worker take (.*?), status and tenant\s+(.*?)\(defaults", text, re.S)
    assert tls, text
    for commands, part in ((("controller", "worker"), tls.group(1)), (("status", "tenant"), tls.group(2))):
        for c in commands:
            flags[c].update(re.findall(r"--([a-z][a-z0-9-]*)", part))
    return flags


def invocations(text):
    """(command, [flags]) for every `pathways COMMAND ...` in a script, unit or manifest text."""
    text = text.replace("\\\n", " ")
    found = [(m.group(1), re.findall(r"(?<![\w-])--([a-z][a-z0-9-]*)", m.group(2))) for m in INVOCATION.finditer(text)]
    return found


def check_flags(text, known, where):
    found = invocations(text)
    assert found, f"{where}: no pathways command found"
    for command, flags in found:
        unknown = [f for f in flags if f not in known[command]]
        assert not unknown, f"{where}: pathways {command} has no flag(s) {unknown}"
    return found


def manifests():
    return [d for d in yaml.safe_load_all(read("k8s", "pathways.yaml")) if d is not None]


def test_kubernetes_manifests_hang_together(known_flags):
    docs = manifests()
    kinds = {}
    for d in docs:
        for key in ("apiVersion", "kind", "metadata"):
            assert key in d, f"a manifest has no {key}: {d}"
        kinds.setdefault(d["kind"], []).append(d)
    assert {"Service", "Deployment", "StatefulSet"} <= set(kinds), kinds.keys()
    # The Secret is made by the command in the file's header, not by the file (applying it again
    # would put placeholders over the tokens).
    assert "Secret" not in kinds
    header = read("k8s", "pathways.yaml").replace("\\\n#", " ")
    made = re.search(r"kubectl create secret generic (\S+)(.*)", header)
    assert made, "the header does not say how to make the Secret"
    secrets = {made.group(1): set(re.findall(r"--from-literal=([\w-]+)=", made.group(2)))}
    workloads = kinds["Deployment"] + kinds["StatefulSet"]
    for w in workloads:
        spec = w["spec"]
        labels = spec["template"]["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items(), w["metadata"]["name"]
        for c in spec["template"]["spec"]["containers"]:
            assert c["image"].startswith("pathways:"), c["image"]
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets.get(ref["name"], set()), f"secret {ref} is not defined"
            command_line = " ".join(c.get("command", []) + c.get("args", []))
            if not command_line.startswith("/usr/bin/pathways") and "exec " not in command_line:
                command_line = "pathways " + command_line  # args given to the image's entrypoint
            check_flags(command_line, known_flags, f"{w['kind']} {w['metadata']['name']}")
            ports = {p["containerPort"] for p in c.get("ports", [])}
            for port in re.findall(r"--listen\s+\S*:(\d+)", command_line):
                assert int(port) in ports, f"{w['metadata']['name']} listens on {port} but does not declare it"
    # Every Service selects a workload, and its target ports are ones that workload declares.
    for s in kinds["Service"]:
        selector = s["spec"]["selector"]
        matched = [w for w in workloads if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert matched, f"service {s['metadata']['name']} selects nothing"
        declared = {p["containerPort"] for w in matched for c in w["spec"]["template"]["spec"]["containers"]
                    for p in c.get("ports", [])}
        for p in s["spec"]["ports"]:
            assert p.get("targetPort", p["port"]) in declared, f"service {s['metadata']['name']} port {p}"
    # Workers reach the controller by its Service's name.
    service_names = {s["metadata"]["name"] for s in kinds["Service"]}
    for w in kinds["StatefulSet"]:
        text = " ".join(" ".join(c.get("args", [])) for c in w["spec"]["template"]["spec"]["containers"])
        host = re.search(r"--controller\s+([\w.-]+):\d+", text).group(1)
        assert host in service_names, host
        assert w["spec"]["serviceName"] in service_names


@pytest.mark.parametrize("unit", ["pathways-controller.service", "pathways-worker.service"])
def test_systemd_units_are_well_formed(unit, known_flags):
    text = read("systemd", unit)
    sections = re.findall(r"^\[(\w+)\]$", text, re.M)
    assert sections == ["Unit", "Service", "Install"], sections
    exec_start = re.search(r"^ExecStart=(\S+)(.*)$", text, re.M)
    assert exec_start and exec_start.group(1) == "/usr/bin/pathways", text
    check_flags("/usr/bin/pathways" + exec_start.group(2), known_flags, unit)
    env_file = re.search(r"^EnvironmentFile=(\S+)$", text, re.M).group(1)
    for var in re.findall(r"\$\{(\w+)\}", exec_start.group(2)):
        assert re.search(rf"{var}=", text), f"{unit}: ${var} is not shown in the set-up of {env_file}"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_accepts_the_units_with_tls_on(tmp_path):
    """systemd's own check of the units, with their TLS lines uncommented and the binary under test
    in place of /usr/bin/pathways (verify requires the executable to exist)."""
    units = []
    for unit in ("pathways-controller.service", "pathways-worker.service"):
        text = read("systemd", unit).replace("/usr/bin/pathways", os.environ["PATHWAYS_BINARY"])
        text = re.sub(r"^#(LoadCredential|Environment)=", r"\1=", text, flags=re.M)
        (tmp_path / unit).write_text(text)
        units.append(str(tmp_path / unit))
    out = subprocess.run(["systemd-analyze", "verify", "--man=no", *units], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and not out.stderr.strip(), out.stderr


def test_slurm_script_parses_and_uses_known_flags(known_flags):
    path = os.path.join(HERE, "slurm", "pathways.sbatch")
    syntax = subprocess.run(["bash", "-n", path], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    text = read("slurm", "pathways.sbatch")
    assert re.search(r"^#SBATCH --nodes=", text, re.M)
    found = check_flags(text, known_flags, "pathways.sbatch")
    assert {"controller", "worker", "status", "tenant"} <= {c for c, _ in found}, found


@pytest.mark.parametrize("script", [("slurm", "check_local.sh"), ("container_check.sh",)])
def test_checks_run_by_hand_parse(script):
    """make check-slurm and make check-container run as root, by hand: here only their syntax."""
    syntax = subprocess.run(["bash", "-n", os.path.join(HERE, *script)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr


def test_clean_debian_check_parses_and_uses_known_flags(known_flags):
    """The clean-Debian check (make check-package) is run by hand, as root: here only its shell
    syntax and the flags it gives the installed binary are checked."""
    path = os.path.join(HERE, "clean_debian_check.sh")
    syntax = subprocess.run(["sh", "-n", path], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    found = check_flags(read("clean_debian_check.sh"), known_flags, "clean_debian_check.sh")
    assert {"controller", "worker", "demo", "train"} <= {c for c, _ in found}, found


def test_dockerfile_builds_on_debian_12_and_runs_the_binary():
    text = read("Dockerfile")
    stages = re.findall(r"^FROM (\S+)", text, re.M)
    assert stages and all(s == "debian:12" for s in stages), stages
    assert re.search(r'^ENTRYPOINT \["/usr/bin/pathways"\]$', text, re.M)
    assert "make package" in text


def test_flag_check_catches_an_unknown_flag(known_flags):
    with pytest.raises(AssertionError, match="no-such-flag"):
        check_flags("pathways worker --controller a:1 --no-such-flag 3", known_flags, "probe")
