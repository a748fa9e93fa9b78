#!/usr/bin/env bash
# promtool (Prometheus's checker) for the metrics and alerting-rules tests, the same for CI and
# developers: the promtool binary of Debian's prometheus package (about 19 MB; see
# deb_binary_env.sh: the package is never installed, so no Prometheus service runs). Prints its path.
exec bash "$(dirname "${BASH_SOURCE[0]}")/deb_binary_env.sh" promtool prometheus "Prometheus's promtool"
