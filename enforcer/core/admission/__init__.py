"""The webhook's decision (pure): an AdmissionReview in, an AdmissionReview out.

A pod that declares VRAM gets the sidecar (with a socket of its own that the agent connects
to), a shared PID namespace, its limits in the environment and, by default, a real
`/dev/shm`. Everything a user can get wrong is denied with a message that names the
container, the field, the value and the fix. The parts:

- `review`: which pods are ours, the checks and denials, the mutation put together;
- `sidecar`: what is injected (the sidecar and its environment, `/dev/shm`, the workload's
  environment);
- `isolation`: the other containers kept out of the sidecar (KILL dropped, nothing that
  could ptrace it) and under its AppArmor and SELinux labels;
- `ephemeral`: ephemeral containers added to an injected pod, held as its other containers;
- `undeclared`: a container that asks for a GPU and declares no VRAM, denied, given the
  operator's default, or observed, as its namespace says;
- `claims`: DRA mode's claims from ResourceClaimTemplates of ours;
- `patch`: the JSON patch, built at the paths the mutation changes;
- `common`: the settings, the denial, our annotations, how a pod's containers are walked.
"""

from enforcer.core.admission.claims import claim_template as claim_template
from enforcer.core.admission.common import INJECTED as INJECTED
from enforcer.core.admission.common import AdmissionSettings as AdmissionSettings
from enforcer.core.admission.common import Denied as Denied
from enforcer.core.admission.review import BadReview as BadReview
from enforcer.core.admission.review import decode as decode
from enforcer.core.admission.review import mutate as mutate
from enforcer.core.admission.review import review as review
from enforcer.core.admission.review import sidecar_mode_for as sidecar_mode_for
from enforcer.core.admission.review import templates_named as templates_named
from enforcer.core.admission.sidecar import TOKEN_DIR as TOKEN_DIR
from enforcer.core.parsing import format_quantity as format_quantity
