"""Release and CI tooling: run on the host and inside the build containers (see docs/release.md)."""
