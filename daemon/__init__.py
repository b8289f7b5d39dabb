"""edgevlm.daemon: the MQTT v5 daemon (``edgevlm serve``).

:mod:`~edgevlm.daemon.app` wires camera sources (:mod:`~edgevlm.daemon.sources`), the inference
scheduler (:mod:`~edgevlm.daemon.scheduler`) and the MQTT front end
(:mod:`~edgevlm.daemon.mqtt_bridge`). Nothing is imported here, so importing a submodule stays light.
"""
