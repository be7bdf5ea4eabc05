"""The live dashboard in a real browser: starts the server (API key, collaboration groups of
`moeserve analyze`, a live reservoir), drives a little traffic, opens GET /dashboard in headless
Chromium (Debian's chromium + chromium-driver, driven by selenium), types the API key into the
page, and waits until the heatmap has non-zero cells, the collaboration graph has nodes and
edges drawn as SVG elements, the group-usage table has a row per group and the load chart has
points; the browser console must show no error. A screenshot is saved as a test artifact:
$MOESERVE_ARTIFACTS/dashboard.png (default: the build folder next to the binary).
Skipped (exit 77) with a message only when chromium, chromedriver or selenium is missing
(tools/setup.sh installs them)."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

import srvtest

KEY = "sk-dashboard-test"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    HAVE_SELENIUM = True
except ImportError:
    HAVE_SELENIUM = False

MISSING = ", ".join(n for n, ok in (("chromium", CHROMIUM), ("chromedriver", DRIVER),
                                    ("python selenium", HAVE_SELENIUM)) if not ok)


@unittest.skipIf(MISSING, "headless browser test needs %s (tools/setup.sh installs them)" % MISSING)
class DashboardBrowserTest(unittest.TestCase):
    def test_dashboard_renders(self):
        tmp = tempfile.mkdtemp()
        try:
            groups = os.path.join(tmp, "groups.json")
            trace = os.path.join(srvtest.tests_dir(), "fixtures", "routing",
                                 "mohge_small_heldout.rtrace")
            p = subprocess.run([srvtest.binary(), "analyze", "--calib", trace, "--out", groups,
                                "--groups", "4", "--model", srvtest.bundled_model()],
                               capture_output=True, timeout=300)
            self.assertEqual(p.returncode, 0, p.stderr.decode())
            with srvtest.Server("--api-key", KEY, "--collab-groups", groups,
                                "--collab-reservoir", "2048",
                                model=srvtest.bundled_model()) as srv:
                self.run_browser(srv, tmp)
        finally:
            shutil.rmtree(tmp)

    def traffic(self, srv, n):
        for i in range(n):
            st, _, r = srvtest.post_json(srv.port, "/v1/completions",
                                         {"prompt": ["12+%d=" % i, "ROMEO: ", '{"k": '][i % 3],
                                          "max_tokens": 12, "ignore_eos": True},
                                         headers={"Authorization": "Bearer " + KEY}, timeout=120)
            self.assertEqual(st, 200, r)

    def run_browser(self, srv, tmp):
        self.traffic(srv, 6)
        opts = webdriver.ChromeOptions()
        opts.binary_location = CHROMIUM
        for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  "--window-size=1280,1200", "--user-data-dir=" + os.path.join(tmp, "profile")):
            opts.add_argument(a)
        opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        drv = webdriver.Chrome(service=Service(DRIVER), options=opts)
        try:
            drv.set_page_load_timeout(60)
            drv.get(srv.base + "/dashboard")
            # without a key the page asks for one
            srvtest.wait_until(lambda: drv.find_element(By.ID, "keybox").is_displayed(), 30,
                               "the API key box")
            drv.find_element(By.ID, "key").send_keys(KEY)
            drv.find_element(By.ID, "keybtn").click()

            def attr(elem_id, name):
                v = drv.find_element(By.ID, elem_id).get_attribute(name)
                return int(v) if v else 0

            # traffic while the page polls, so the load chart gets points a second apart
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                self.traffic(srv, 2)
                if (attr("heatmap", "data-cells") > 0 and attr("graph", "data-edges") > 0 and
                        attr("load", "data-points") >= 2):
                    break
                time.sleep(0.5)
            self.assertGreater(attr("heatmap", "data-cells"), 16)  # cells of routed experts
            nodes = drv.find_elements(By.CSS_SELECTOR, "#graph circle.node")
            edges = drv.find_elements(By.CSS_SELECTOR, "#graph line.edge")
            self.assertGreater(len(nodes), 8)
            self.assertEqual(len(nodes), attr("graph", "data-nodes"))
            self.assertGreater(len(edges), 0)
            self.assertEqual(len(edges), attr("graph", "data-edges"))
            self.assertGreaterEqual(attr("load", "data-points"), 2)
            self.assertGreater(len(drv.find_elements(By.CSS_SELECTOR, "#load polyline.device")), 0)
            rows = drv.find_elements(By.CSS_SELECTOR, "#groups tr")
            self.assertEqual(len(rows), 1 + 4)  # header + a row per group
            # each group says what it does (its label from GROUPS.json)
            for r in rows[1:]:
                self.assertIn(" tokens", r.find_elements(By.TAG_NAME, "td")[1].text)
            self.assertNotIn("error", drv.find_element(By.ID, "status").get_attribute("class"))
            # the heatmap's canvas really has colour in it
            drawn = drv.execute_script(
                "const c = document.getElementById('heatmap').getContext('2d');"
                "const d = c.getImageData(0, 0, 900, 160).data; let n = 0;"
                "for (let i = 0; i < d.length; i += 4) if (d[i + 3] > 0 && d[i] < 250) n++;"
                "return n;")
            self.assertGreater(drawn, 1000)
            errors = [e for e in drv.get_log("browser") if e.get("level") == "SEVERE"]
            # the first poll, before the key was typed, is a 401 the page handles (the console
            # reports the failed fetch); nothing else may fail
            errors = [e for e in errors if "401" not in e.get("message", "")]
            self.assertEqual(errors, [], [e.get("message") for e in errors])
            out = os.environ.get("MOESERVE_ARTIFACTS", os.path.dirname(srvtest.binary()))
            os.makedirs(out, exist_ok=True)
            shot = os.path.join(out, "dashboard.png")
            drv.save_screenshot(shot)
            self.assertGreater(os.path.getsize(shot), 10000)
            print("screenshot: %s" % shot, file=sys.stderr)
        finally:
            drv.quit()


if __name__ == "__main__":
    srvtest.main()
