"""Container images on the controller: a bounded squashfs reader (:mod:`.squashfs`) and
the NCCL fingerprint of one image (:mod:`.fingerprint`). docs/containers.md."""
