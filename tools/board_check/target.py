"""The machine the board's installs are resolved for, as pip's tag options and as marker values."""

from __future__ import annotations

from dataclasses import dataclass

from packaging.requirements import Requirement


@dataclass(frozen=True)
class Target:
    """A Linux machine pip resolves wheels for. The defaults are an Orin on JetPack 6: Ubuntu 22.04's CPython
    3.10.12 and glibc 2.35 on aarch64.

    pip's --platform/--python-version choose wheel tags but leave environment markers to the machine pip runs on
    (x86-64 here), so `marker_environment` is what the resolver evaluates every requirement's marker against.
    """

    machine: str = "aarch64"
    python_full_version: str = "3.10.12"
    glibc: tuple[int, int] = (2, 35)
    # the oldest manylinux glibc a wheel may target: manylinux2014 is glibc 2.17
    oldest_glibc_minor: int = 17

    def __post_init__(self) -> None:
        parts = self.python_full_version.split(".")
        if len(parts) != 3 or not all(p.isdigit() for p in parts) or parts[0] != "3":
            raise ValueError(f"python_full_version must be like 3.10.12, got {self.python_full_version!r}")
        if self.glibc[0] != 2 or not self.oldest_glibc_minor <= self.glibc[1]:
            raise ValueError(f"glibc must be 2.x with x >= {self.oldest_glibc_minor} (manylinux2014), got "
                             f"{self.glibc}")
        if not self.machine or not self.machine.replace("_", "").isalnum():
            raise ValueError(f"machine must be a `uname -m` name such as aarch64, got {self.machine!r}")

    @property
    def python_version(self) -> str:
        return ".".join(self.python_full_version.split(".")[:2])

    @property
    def abi(self) -> str:
        return "cp" + self.python_version.replace(".", "")

    def describe(self) -> str:
        return f"{self.machine}, CPython {self.python_version}, glibc {self.glibc[0]}.{self.glibc[1]}"

    def marker_environment(self, extra: str = "") -> dict[str, str]:
        """PEP 508 marker values on this machine; `extra` names the extra being installed ("" for none)."""
        return {"implementation_name": "cpython", "implementation_version": self.python_full_version,
                "os_name": "posix", "platform_machine": self.machine, "platform_python_implementation": "CPython",
                "platform_release": "", "platform_system": "Linux", "platform_version": "",
                "python_full_version": self.python_full_version, "python_version": self.python_version,
                "sys_platform": "linux", "extra": extra}

    def applies(self, requirement: Requirement, extras: frozenset[str] = frozenset()) -> bool:
        """Whether pip on this machine installs `requirement`, asked for with these extras of its requirer."""
        if requirement.marker is None:
            return True
        return any(requirement.marker.evaluate(self.marker_environment(extra)) for extra in ("", *sorted(extras)))

    def pip_arguments(self) -> list[str]:
        """pip's options choosing this machine's wheels, and only wheels."""
        platforms = [f"manylinux_2_{minor}_{self.machine}"
                     for minor in range(self.glibc[1], self.oldest_glibc_minor - 1, -1)]
        platforms.append(f"manylinux2014_{self.machine}")
        out = ["--only-binary=:all:", "--implementation", "cp", "--python-version", self.python_version]
        for abi in (self.abi, "abi3", "none"):
            out += ["--abi", abi]
        for platform in platforms:
            out += ["--platform", platform]
        return out
