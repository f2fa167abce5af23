#!/usr/bin/env bash
# `make offline-base-image` (on a connected machine): the base image build-offline-image
# starts from, made from Debian packages only: a minimal bookworm (debootstrap minbase) with
# python3 (3.11) and python3-venv, and no curl, wget or git, imported into podman's storage.
# Save it for an air-gapped builder with `podman save -o kunlun-base.tar IMAGE`.
#
#   [BASE_IMAGE=localhost/kunlun-base:bookworm] [MIRROR=http://deb.debian.org/debian]
set -euo pipefail
IMAGE=${BASE_IMAGE:-localhost/kunlun-base:bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
for tool in debootstrap podman; do
  command -v "$tool" >/dev/null 2>&1 || { echo "offline-base-image: needs $tool (Debian: apt-get install $tool)" >&2; exit 2; }
done
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv bookworm "$root" "$MIRROR"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
for t in curl wget git; do
  if [ -e "$root/usr/bin/$t" ]; then echo "offline-base-image: $t is in the base" >&2; exit 1; fi
done
tar -C "$root" -c . | podman import --change 'CMD ["/bin/bash"]' - "$IMAGE"
echo "base image $IMAGE"
