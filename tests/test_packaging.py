"""What a non-editable install gets: the wheel carries the templates and the trained heads, and an installed
copy finds its templates without the source checkout (a user's `pip install .` once failed with "the novel
template is missing from this installation")."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_wheel_ships_the_templates_and_an_installed_copy_finds_them(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("swiftwrite", "kernels", "prompts"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    # build_meta directly: the same backend pip calls, without pip's isolated environment (no network here)
    out = tmp_path / "dist"
    subprocess.run([sys.executable, "-c", f"import setuptools.build_meta as b; b.build_wheel({str(out)!r})"],
                   cwd=src, check=True, capture_output=True)
    wheel = next(out.glob("*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for template in ("novel", "report", "structured", "revise"):
        assert f"swiftwrite/templates/{template}.txt" in names
    assert any(n.startswith("swiftwrite/heads/") and n.endswith(".safetensors") for n in names)
    assert "swiftwrite/models.yaml" in names

    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:  # a wheel is a zip laid out as site-packages: unpacking it installs it
        zf.extractall(site)
    # -I: no PYTHONPATH, no current directory on the path; the unpacked copy goes first, ahead of this
    # environment's own (editable) swiftwrite, and the probe checks which one it imported
    probe = (f"import sys; sys.path.insert(0, {str(site)!r}); import swiftwrite, swiftwrite.prompt as p; "
             "print(swiftwrite.__file__); print(p.apply_template('THE BRIEF', 'novel')); "
             "print(p.apply_template('THE BRIEF', 'report'))")
    r = subprocess.run([sys.executable, "-I", "-c", probe], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(str(site)), f"imported {lines[0]}, not the installed copy"
    assert r.stdout.count("THE BRIEF") == 2
    assert (ROOT / "prompts" / "novel.txt").read_text().split("{brief}")[0].strip() in r.stdout
