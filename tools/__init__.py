"""The build and release tooling: the nox sessions' shared code (sessions.py, util.py), the release sessions
(release.py), the version file (matrix.toml, read by matrix.py) and the scripts the containers run. The CI entry
point is .ci/run; the map of this package is in docs/DESIGN-NOTES.md ("Tooling")."""
