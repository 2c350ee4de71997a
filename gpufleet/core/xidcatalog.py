"""NVIDIA's Xid catalog as sets of codes per "Resolution Bucket (Immediate Action)" (pure data).

Transcribed per code as NVIDIA ships it in github.com/NVIDIA/NVSentinel,
distros/kubernetes/nvsentinel/charts/gpu-health-monitor/xiderrorsmapping.csv (the sources are
in core/health.py's docstring, which turns a bucket into a severity and an action). Kept apart
so the health gate's logic reads without a page of numbers.
"""
from __future__ import annotations

RESTART_APP_XIDS = frozenset([8, 11, 13, 25, 31, 32, 39, 40, 41, 60, 68, 69, 70, 71, 72, 75, 76,
                               77, 80, 82, 83, 84, 85, 86, 88, 89, 94, 96, 97, 98, 99, 100,
                               101, 102, 103, 104, 105, 126, 127, 128, 129, 130, 131, 132, 133,
                               134, 135, 139])
RESET_GPU_XIDS = frozenset([46, 48, 62, 64, 74, 95, 109, 110, 119, 120, 136, 140, 143, 144,
                             145, 146, 147, 148, 149, 150, 155, 156, 158, 162])
RESTART_BM_XIDS = frozenset([79, 160])
# IGNORE (and WORKFLOW_XID_45: channel teardown on a normal exit or kill, benign)
IGNORE_XIDS = frozenset([14, 37, 38, 43, 44, 45, 63, 66, 67, 92, 93, 106, 107, 121, 137, 141,
                          152, 153, 157, 161])
CHECK_MECHANICALS_XIDS = frozenset([54])
XID_NAMES = {13: "Graphics Engine Exception", 31: "GPU memory page fault",
             43: "GPU stopped processing", 45: "preemptive cleanup", 48: "double bit ECC error",
             63: "row remapping recorded", 64: "row remapping failure", 74: "NVLink error",
             79: "GPU has fallen off the bus", 92: "high single-bit ECC error rate",
             94: "contained ECC error", 95: "uncontained ECC error", 119: "GSP RPC timeout",
             120: "GSP error"}
