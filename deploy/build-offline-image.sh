#!/usr/bin/env bash
# `make build-offline-image`: an OCI image of Kunlun Platform built from the signed offline
# bundle, with no network during the build and no curl, wget or git inside; its digest is
# signed with the bundle's key. Needs podman (or buildah) that can run here and a base image
# with Python 3.11+ (and venv) already in local storage: `make offline-base-image` makes one
# from Debian packages; an air-gapped builder loads it with `podman load -i base.tar`.
#
#   KEY=keys/kunlun-signing.key [BUNDLE=kunlun-offline.tar] [BASE_IMAGE=localhost/kunlun-base:bookworm]
#   [IMAGE=kunlun-platform-offline:latest] deploy/build-offline-image.sh
set -euo pipefail
KEY=${KEY:?give KEY=path/to/kunlun-signing.key (the bundle is signed with it)}
BUNDLE=${BUNDLE:-kunlun-offline.tar}
BASE_IMAGE=${BASE_IMAGE:-localhost/kunlun-base:bookworm}
IMAGE=${IMAGE:-kunlun-platform-offline:latest}
BIN=${BIN:-.venv/bin}

tool=""
for candidate in podman buildah; do
  if command -v "$candidate" >/dev/null 2>&1; then
    if why=$("$candidate" info 2>&1 >/dev/null); then tool=$candidate; break; fi
    echo "build-offline-image: $candidate is installed but cannot run here: ${why##*$'\n'}" >&2
  fi
done
if [ -z "$tool" ]; then
  echo "build-offline-image: neither podman nor buildah can run on this machine; nothing built" >&2
  echo "  (Debian: apt-get install podman; in a container it also needs user namespaces and fuse-overlayfs)" >&2
  exit 2
fi
if ! "$tool" image exists "$BASE_IMAGE" 2>/dev/null; then
  echo "build-offline-image: base image $BASE_IMAGE is not in local storage; nothing is pulled" >&2
  echo "  (make one: make offline-base-image; or load one: $tool load -i base.tar; or set BASE_IMAGE)" >&2
  exit 2
fi
[ -f "$BUNDLE" ] || "$BIN/kunlun-installer" bundle -o "$BUNDLE" --key "$KEY"
context=$(mktemp -d)
trap 'rm -rf "$context"' EXIT
cp "$BUNDLE" "$context/kunlun-offline.tar"
"$BIN/python" - "$KEY" "$context/kunlun-signing.pub" <<'PY'
import sys
from pathlib import Path
from cryptography.hazmat.primitives import serialization
from kunlun.offline.signing import load_private_key
key = load_private_key(Path(sys.argv[1])).public_key()
Path(sys.argv[2]).write_bytes(key.public_bytes(serialization.Encoding.PEM,
                                               serialization.PublicFormat.SubjectPublicKeyInfo))
PY
cat > "$context/Containerfile" <<CONTAINERFILE
FROM $BASE_IMAGE
COPY kunlun-offline.tar kunlun-signing.pub /tmp/kunlun/
RUN cd /tmp/kunlun && tar -xf kunlun-offline.tar kunlun-installer.pyz \\
 && python3 kunlun-installer.pyz install --bundle kunlun-offline.tar \\
      --public-key kunlun-signing.pub --prefix /opt/kunlun --home /var/lib/kunlun \\
 && rm -rf /tmp/kunlun \\
 && for t in curl wget git; do if command -v \$t; then echo "\$t is in the image" >&2; exit 1; fi; done
ENV KUNLUN_HOME=/var/lib/kunlun PATH=/opt/kunlun/bin:\$PATH
EXPOSE 8470
ENTRYPOINT ["/opt/kunlun/bin/kunlun-platform", "--host", "0.0.0.0", "--require-signed", \
            "--trusted-keys", "/var/lib/kunlun/trusted-keys"]
CONTAINERFILE
# No network during the build: the OCI runtime's own (--network none); where the runtime
# cannot start containers here (e.g. cgroups in hybrid mode inside a container), RUN steps
# go through chroot isolation instead, inside a network namespace with no interfaces.
build=(--pull=never -t "$IMAGE" "$context")
[ "$tool" = buildah ] && build=(--pull-never -t "$IMAGE" "$context")
sub=build; [ "$tool" = buildah ] && sub=bud
if "$tool" run --rm --network=none "$BASE_IMAGE" true >/dev/null 2>&1 || \
   { [ "$tool" = buildah ] && ctr=$(buildah from --pull-never "$BASE_IMAGE") && buildah run --network none "$ctr" true && buildah rm "$ctr" >/dev/null; }; then
  "$tool" "$sub" --network=none "${build[@]}"
else
  echo "build-offline-image: the OCI runtime cannot run containers here; building with chroot isolation in a network namespace with no interfaces (unshare -n)" >&2
  unshare -n "$tool" "$sub" --isolation=chroot --network=host "${build[@]}"
fi
if [ "$tool" = podman ]; then
  digest=$(podman image inspect --format '{{.Digest}}' "$IMAGE")
else
  digest=$(buildah inspect --type image --format '{{.FromImageDigest}}' "$IMAGE")
fi
echo "$IMAGE $digest" > kunlun-offline-image.digest
"$BIN/kunlun-cli" keys sign kunlun-offline-image.digest --key "$KEY"
echo "image $IMAGE digest $digest; signed: kunlun-offline-image.digest(.sig)"
