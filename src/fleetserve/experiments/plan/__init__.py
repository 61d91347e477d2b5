"""``fleetserve plan``: the cheapest fleet that meets every service's SLOs.

* :mod:`.spec`: the plan file (services, traffic, SLOs, GPU options, search);
* :mod:`.traffic`: the requests every candidate is simulated on;
* :mod:`.bounds`: infeasibility checks and pool-size lower bounds;
* :mod:`.search`: branch and bound with bisection, as pure generators;
* :mod:`.evaluate`: one candidate simulated and judged;
* :mod:`.run`: the whole procedure; :mod:`.report`: its outputs.
"""
