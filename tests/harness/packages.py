"""The exact Debian packages and tarballs the tests run against, pinned by version and SHA256."""

from __future__ import annotations

from .debs import Deb
from .tarballs import Tarball

# containerd 1.7.24 carries NRI 0.6.1 (trixie); 2.1.9 carries NRI 0.8.0 (sid).  Both need only
# GLIBC_2.34, so they run on bookworm.  runc comes from bookworm: trixie's needs GLIBC_2.38.
CONTAINERD_17 = Deb(
    "containerd",
    "1.7.24~ds1-6+deb13u1",
    "ed708deb96fe476a3bce4efa5c0538dfbcf717ab9a7c7944ba7260342c25899c",
)
CONTAINERD_21 = Deb(
    "containerd", "2.1.9+ds1-5", "2dda86ce7033fd612fc50e136679d8174ccad680eb29cd4611e0d2a1b84cf591"
)
RUNC = Deb(
    "runc",
    "1.1.5+ds1-1+deb12u1",
    "a00351f8c0318de0b424ecf5cd0fdb69880a89f3511cae4f6fff7de3e57881c5",
)
# crun 1.8.1 from bookworm: CRI-O's default OCI runtime on Fedora, RHEL and OpenShift, run by
# containerd (io.containerd.runc.v2 with BinaryName) and CRI-O (harness/crun.py).  Its one
# library the host lacks, libyajl2, is bookworm's too; patchelf points crun at it.
CRUN = Deb(
    "crun",
    "1.8.1-1+deb12u1",
    "34bdcf1a097ec34da2e7b77b65fa351134702af775174af22555b16421709c51",
)
LIBYAJL2 = Deb(
    "libyajl2",
    "2.1.0-3+deb12u2",
    "b512a6efbe735e7c731185a1b3ea477ff306f0c3f6aa2970e85b12f01fe8063b",
)
# runc 1.3 for the trixie guest (guest_image.TRIXIE): current containerd releases ship runc
# 1.2/1.3, and no Debian suite but sid carries 1.3 (experimental has moved on to 1.4).  It
# needs GLIBC_2.38, so it runs in that guest only, from the lab (`dpkg -x`).
RUNC_13 = Deb(
    "runc", "1.3.6+ds1-1", "8e95d7bdfd22242ae4d48d58e3c277ba2b69dffc4ed8e573b837e6e93925d911"
)
BUSYBOX_STATIC = Deb(
    "busybox-static",
    "1:1.35.0-4+deb12u1+b1",
    "3d3fdbe91d4660c873e14b092c213fe81c1da6362daa236eb25d0171eb108744",
)
# Upstream Go sources: the NRI api.proto our own .proto must match, and the CRI api.proto the
# test client is generated from.
NRI_API_061 = Deb(
    "golang-github-containerd-nri-dev",
    "0.6.1-2",
    "13fd28aa658d48ae70e640a6d2687e7327adce1786abb078954418adfc92c1a8",
    arch="all",
)
NRI_API_080 = Deb(
    "golang-github-containerd-nri-dev",
    "0.8.0-1",
    "8081f1a966e3670dcfed1202bf533902a3f3fead6c29c00a6091a7de2409bcf7",
    arch="all",
)
TTRPC_124 = Deb(
    "golang-github-containerd-ttrpc-dev",
    "1.2.4-2",
    "706e0150076e067d70ff381b2cfb451e200ed3a23a9159c0daf8764fc259b8e8",
    arch="all",
)
TTRPC_127 = Deb(
    "golang-github-containerd-ttrpc-dev",
    "1.2.7-1",
    "6e3462238cf8258c31e5cec47ff7fc00ce5785711215301df4828feccc151bb6",
    arch="all",
)
CRI_API = Deb(
    "golang-github-kubernetes-cri-api-dev",
    "0.32.3-1",
    "634610347b36362eb4614eb98c494cb9363d5d873da99806ba2b181460a93b20",
    arch="all",
)

# podman 4.3.1 from bookworm, run from `dpkg -x` (tests/harness/podman.py): the same
# containers/common hooks.d code CRI-O uses, with bookworm's runc (podman runs crun 1.8.1
# without harness/crun.py's wrapper, and it refuses this host's hybrid cgroup layout).
# patchelf points the extracted binaries at the extracted libraries (conmon starts podman's
# cleanup with a scrubbed environment).
PODMAN = Deb(
    "podman",
    "4.3.1+ds1-8+deb12u1+b3",
    "881ab556a1df5b911359c83a647597eb36c156a8615e754436e520a6ae0661ab",
)
CONMON = Deb(
    "conmon", "2.1.6+ds1-1", "2d4111853199dd8c7cbcda3da04f37d9b7f3a7b08dc1cee546a1e5518de8a596"
)
CONTAINERS_COMMON = Deb(
    "golang-github-containers-common",
    "0.50.1+ds1-4",
    "39d5c31902c4ce55bd419286946d0b291383169585f1b3509000f6bf57454181",
    arch="all",
)
CONTAINERS_IMAGE = Deb(
    "golang-github-containers-image",
    "5.23.1-4",
    "2dc5697a30ae8de43221eeb7aa553d5187dbf97392d299ecb27ef51e46d159ca",
    arch="all",
)
LIBGPGME = Deb(
    "libgpgme11", "1.18.0-3+b1", "dc075584050dc5c8ac27563fc222e8c1ea71128a019a6d129d5823e47ac1e55e"
)
LIBSUBID = Deb(
    "libsubid4",
    "1:4.13+dfsg1-1+deb12u2",
    "5c1c214484e57bcfaff4136e6cdbe4e8108776c7159ce7c9087218896a5eb12d",
)
PATCHELF = Deb(
    "patchelf", "0.14.3-1+b1", "0364b90e81faabbb9569076063952c7bcbf07f83d954a2f2602a163d65be60e6"
)
PODMAN_STACK = (PODMAN, CONMON, CONTAINERS_COMMON, CONTAINERS_IMAGE, LIBGPGME, LIBSUBID)

# containerd 2.3.4 (NRI 0.12.0, ttrpc 1.2.8): no Debian suite has containerd >= 2.2, so it comes
# from the shared runtimes directory (harness/tarballs.py), built from its tagged source with
# vendored modules; containerd and ctr need only bookworm's libc, the shim is static.
CONTAINERD_23 = Tarball(
    "containerd",
    "containerd-2.3.4-linux-amd64.tar.gz",
    "fd6e623a4f6e89ad3ded8691dc8941462a064727950ceb42454d20e498705282",
    files={
        "bin/containerd": "3ebf0b78a80a76aa549763b61d908caad37bce460b7cd4b21c9e725b517c0a84",
        "bin/containerd-shim-runc-v2": (
            "6709add7b545fa924d44831d63431b61c6fd285726a98428d94df0bed4853d7e"
        ),
        "bin/ctr": "60175d03ea27eabf80f334e83dac5653a1091d378f63c8d90973a77fe3eb0d68",
    },
)
# Its source (tag v2.3.4): the NRI 0.12.0 schema our api/nri.proto is checked against, and the
# default validator the fail-closed tests and docs rely on, from its vendor tree.
NRI_012_VENDOR = "vendor/github.com/containerd/nri"
CONTAINERD_23_SRC = Tarball(
    "containerd",
    "containerd-2.3.4-src.tar.gz",
    "04d437f718bd820a05466bf8dfcc21f2e9d62c5582bd7d3b5a17edd6c63537f1",
    files={
        f"{NRI_012_VENDOR}/pkg/api/api.proto": (
            "ef3351465898653fdb032d23becedbd25007c3eea426d1a12847964924ab2281"
        ),
        f"{NRI_012_VENDOR}/plugins/default-validator/default-validator.go": (
            "926d885784723b037238ee5842fd446b3a4790bc15bf1a955fc8f292647b479f"
        ),
        f"{NRI_012_VENDOR}/pkg/plugin/annotations.go": (
            "3fd7cea4e73b9b51603648f80dcde3328456b5ace328dba287d17289a5c930f9"
        ),
        "vendor/modules.txt": "cb3a2868eb500338ab1b4c742df86c15d8b78c4936222badc8c21a8f7dc972f4",
    },
    top="containerd-2.3.4",
)
# CRI-O 1.36.3's source: the NRI 0.11.0 schema it vendors (CRI-O >= 1.34 speaks NRI >= 0.10).
CRIO_136_SRC = Tarball(
    "cri-o",
    "cri-o-1.36.3-src.tar.gz",
    "ba516607443c63ccf4e355ffcb1892b20cfd0e8d011be2c4cd843669f73dcb36",
    files={
        "vendor/github.com/containerd/nri/pkg/api/api.proto": (
            "86806f617e5a68d543d73c9a4c49876ca8e74b82ffac942efc6813d8bb6b978b"
        ),
        "vendor/modules.txt": "e4f0f72fbfca285a9a110d790c74d82cbe20525689c3b73eab9fed6097cf7775",
    },
    top="cri-o-1.36.3",
)
