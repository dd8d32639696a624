from relayd.cli import main

raise SystemExit(main())
